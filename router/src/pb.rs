//! Generated from proto/sluice/v1/shard.proto by build.rs: the shard
//! protocol, public for the launcher's health probe and for stand-in
//! shards in tests.

tonic::include_proto!("sluice.v1");

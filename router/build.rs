// Generates the gRPC client (and a server, for the in-process fake shard used
// by tests) from the one contract in proto/.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Read at run time, not baked in with env!(): worktrees sharing one
    // target folder reuse this script's binary, and a baked-in path would
    // point at whichever checkout compiled it first.
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR")?;
    let proto_dir = std::path::Path::new(&manifest_dir).join("../proto");
    let proto = proto_dir.join("sluice/v1/shard.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&[proto], &[proto_dir])?;
    Ok(())
}

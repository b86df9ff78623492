// Generates the gRPC client (and a server, for the in-process fake shard used
// by tests) from the one contract in proto/.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    let proto = proto_dir.join("sluice/v1/shard.proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    tonic_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(&[proto], &[proto_dir])?;
    Ok(())
}

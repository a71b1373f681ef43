//! Generates the gRPC code from `proto/*.proto` with `protox` (a pure-Rust protobuf compiler), so
//! a fresh machine needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["proto/raft.proto", "proto/admin.proto", "proto/agent.proto"];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    tonic_prost_build::configure()
        // The routing state is encoded once and sent on every router's line: shared, not copied.
        .bytes(".laneway.admin.v1.RoutingUpdate")
        .compile_fds(fds)?;
    Ok(())
}

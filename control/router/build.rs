//! Generates the KServe v2 gRPC service (`proto/grpc_predict_v2.proto`) with `protox`, as
//! laneway-proto does for the cluster's own RPCs: no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let file = "proto/grpc_predict_v2.proto";
    println!("cargo:rerun-if-changed={file}");
    let fds = protox::compile([file], ["proto"])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}

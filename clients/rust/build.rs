//! Generates the ferrum.executor.v1 client stubs from the crate's `proto/` tree (a copy of the
//! repository's `protos/`, kept in sync by `sync-protos.sh` and checked in CI), so the packaged
//! crate builds on its own.
//!
//! protoc comes from the `protoc-bin-vendored` crate (a protoc binary shipped inside a registry
//! package), so a build needs nothing but cargo: no system package, no download at build time.
//! `PROTOC` in the environment overrides it (e.g. a distro protoc).
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let protos = manifest.join("proto");
    let files = [
        protos.join("ferrum/executor/v1/types.proto"),
        protos.join("ferrum/executor/v1/executor.proto"),
    ];
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    println!("cargo:rerun-if-env-changed=PROTOC");

    if std::env::var_os("PROTOC").is_none() {
        // The build script is single-threaded here; prost-build reads PROTOC.
        std::env::set_var("PROTOC", protoc_bin_vendored::protoc_bin_path()?);
    }
    // google/protobuf/struct.proto resolves from the vendored include dir; the generated code maps
    // it to prost_types::Struct (prost's default extern path for well-known types).
    let wkt_include = protoc_bin_vendored::include_path()?;

    // PrefixCacheRecipe's proto comment has an indented formula, which rustdoc would compile as a
    // doctest: generate that message without its comment.
    let mut config = tonic_prost_build::Config::new();
    config.disable_comments([".ferrum.executor.v1.PrefixCacheRecipe"]);
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_with_config(config, &files, &[protos, wkt_include])?;
    Ok(())
}

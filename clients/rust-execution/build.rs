//! Makes ferrum-engine 0.18.4's own integration tests (`tests/*.rs` of the crate cargo fetched)
//! includable by `tests/upstream_*.rs`: each file is copied into OUT_DIR without its inner
//! attributes and `//!` docs (which `include!` cannot take). Nothing is generated into the source
//! tree. The crate is found under `$FERRUM_ENGINE_018_SRC`, else cargo's registry
//! (`$CARGO_HOME`, default `~/.cargo`). When it is not there, each file becomes a
//! `compile_error!` naming the place looked in (only the upstream test targets include them).
use std::path::{Path, PathBuf};

const ENGINE: &str = "ferrum-engine-0.18.4";
const FILES: &[&str] = &[
    "backend_safety_test.rs",
    "chunked_prefill_test.rs",
    "concurrency_stress_test.rs",
    "continuous_batch_test.rs",
    "correctness_test.rs",
    "latency_profile_test.rs",
    "regex_guided_test.rs",
];

fn engine_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FERRUM_ENGINE_018_SRC") {
        return Some(PathBuf::from(dir));
    }
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cargo")))?;
    std::fs::read_dir(home.join("registry/src")).ok()?.flatten().map(|d| d.path().join(ENGINE)).find(|p| p.is_dir())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=FERRUM_ENGINE_018_SRC");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("upstream");
    std::fs::create_dir_all(&out).unwrap();
    let dir = engine_dir();
    for name in FILES {
        let text = match dir.as_ref().map(|d| d.join("tests").join(name)) {
            Some(path) if path.is_file() => {
                println!("cargo:rerun-if-changed={}", path.display());
                let text = std::fs::read_to_string(&path).unwrap();
                text.lines()
                    .filter(|l| !l.trim_start().starts_with("//!") && !l.trim_start().starts_with("#!["))
                    .collect::<Vec<_>>()
                    .join("\n")
            }
            _ => format!("compile_error!(\"{ENGINE}/tests/{name} not found (looked in {dir:?}); set FERRUM_ENGINE_018_SRC\");"),
        };
        std::fs::write(out.join(name), text).unwrap();
    }
}

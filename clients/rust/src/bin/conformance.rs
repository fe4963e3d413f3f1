//! `conformance [SCENARIO] [--endpoint URL] [--profile NAME]`: run the language-neutral conformance
//! scenario (with `--profile`, one of its profiles, e.g. `llama-cpp`).
//!
//! Without `--endpoint` a fresh server is started for the run (the scenario needs one: the
//! configurable executor's decode counter is per server). Prints one line per step and a
//! closing `N passed, N failed` line; exits 1 when a step failed.

use std::path::PathBuf;

use ferrum_remote_executor::conformance::run_scenario_profile;
use ferrum_remote_executor::testing::repo_root;

#[tokio::main]
async fn main() {
    let mut args = std::env::args().skip(1);
    let mut scenario = repo_root().join("tests/conformance/scenario.json");
    let mut endpoint = None;
    let mut profile = String::new();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--endpoint" => endpoint = args.next(),
            "--profile" => profile = args.next().unwrap_or_default(),
            "-h" | "--help" => {
                eprintln!("usage: conformance [SCENARIO.json] [--endpoint http://HOST:PORT] [--profile NAME]");
                return;
            }
            other => scenario = PathBuf::from(other),
        }
    }
    match run_scenario_profile(&scenario, &profile, endpoint).await {
        Ok(report) => {
            for l in report.lines() {
                println!("{l}");
            }
            println!("{} passed, {} failed", report.passed(), report.failed());
            if report.failed() > 0 {
                std::process::exit(1);
            }
        }
        Err(e) => {
            eprintln!("conformance: {e}");
            std::process::exit(2);
        }
    }
}

//! The language-neutral conformance scenario (`tests/conformance/scenario.json`) against a fresh
//! server: the same tokens and status codes as every other client's runner. Once with the
//! scenario's own models, once with profile `llama-cpp` (the model `tiny` on the llama.cpp executor).

use ferrum_remote_executor::conformance::run_scenario_profile;
use ferrum_remote_executor::testing::repo_root;

async fn run_profile(profile: &str) {
    let path = std::env::var("FERRUM_CONFORMANCE_SCENARIO")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("tests/conformance/scenario.json"));
    let report = run_scenario_profile(&path, profile, None).await.expect("run the scenario");
    let mut failures = Vec::new();
    for (r, line) in report.results.iter().zip(report.lines()) {
        println!("{line}");
        if !r.ok {
            println!("     observed: {}", r.observed);
            failures.push(line);
        }
    }
    println!("scenario{}: {} steps ok, {} failing", if profile.is_empty() { String::new() } else { format!(" (profile {profile})") },
        report.passed(), report.failed());
    assert!(report.passed() > 0, "the scenario ran no step");
    assert!(failures.is_empty(), "conformance failures:\n{}", failures.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenario() {
    run_profile("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenario_llama_cpp() {
    run_profile("llama-cpp").await;
}

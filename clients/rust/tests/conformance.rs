//! The language-neutral conformance scenario (`tests/conformance/scenario.json`) against a fresh
//! server: the same tokens and status codes as every other client's runner.

use ferrum_remote_executor::conformance::run_scenario_file;
use ferrum_remote_executor::testing::repo_root;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_scenario() {
    let path = std::env::var("FERRUM_CONFORMANCE_SCENARIO")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| repo_root().join("tests/conformance/scenario.json"));
    let report = run_scenario_file(&path, None).await.expect("run the scenario");
    let mut failures = Vec::new();
    for (r, line) in report.results.iter().zip(report.lines()) {
        println!("{line}");
        if !r.ok {
            println!("     observed: {}", r.observed);
            failures.push(line);
        }
    }
    println!("scenario: {} steps ok, {} failing", report.passed(), report.failed());
    assert!(report.passed() > 0, "the scenario ran no step");
    assert!(failures.is_empty(), "conformance failures:\n{}", failures.join("\n"));
}

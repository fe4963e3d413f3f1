// Package testserver starts fresh ferrum-service servers on loopback for tests, the conformance
// runner and the examples.
//
// The server command is $FERRUM_SERVER_CMD (split on spaces), else <repo>/.venv/bin/ferrum-service.
// The tiny random-weight llama of the conformance scenario is built (once, cached under
// ${FERRUM_CACHE_DIR:-~/.cache/ferrum-service}/conformance) by tests/conformance/harness.py with the
// Python next to the server command ($FERRUM_PYTHON overrides).
package testserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ferrum-service/ferrum-service/clients/go/ferrum"
)

// ErrNoServer means no server command was found (tests skip on it).
var ErrNoServer = errors.New("no ferrum-service command: set FERRUM_SERVER_CMD or create the venv (<repo>/.venv)")

// RepoRoot is the ferrum-service checkout this module lives in (the directory holding protos/ferrum).
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if st, err := os.Stat(filepath.Join(dir, "protos", "ferrum")); err == nil && st.IsDir() {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("testserver: not inside a ferrum-service checkout (no protos/ferrum above the working directory)")
		}
		dir = parent
	}
}

// ServerCommand is the command that runs `ferrum-service` (without "serve").
func ServerCommand() ([]string, error) {
	if v := strings.TrimSpace(os.Getenv("FERRUM_SERVER_CMD")); v != "" {
		return strings.Fields(v), nil
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, ErrNoServer
	}
	exe := filepath.Join(root, ".venv", "bin", "ferrum-service")
	if _, err := os.Stat(exe); err != nil {
		return nil, ErrNoServer
	}
	return []string{exe}, nil
}

// Python is the interpreter that has ferrum_service installed.
func Python() string {
	if v := os.Getenv("FERRUM_PYTHON"); v != "" {
		return v
	}
	if cmd, err := ServerCommand(); err == nil {
		if exe, err := exec.LookPath(cmd[0]); err == nil {
			if py := filepath.Join(filepath.Dir(exe), "python"); fileExists(py) {
				return py
			}
		}
	}
	if root, err := RepoRoot(); err == nil {
		if py := filepath.Join(root, ".venv", "bin", "python"); fileExists(py) {
			return py
		}
	}
	return "python3"
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// ScenarioPath is tests/conformance/scenario.json of the checkout.
func ScenarioPath() (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	return filepath.Join(root, "tests", "conformance", "scenario.json"), nil
}

// TinyModelDir builds (once) and returns the tiny random-weight llama's directory.
func TinyModelDir(ctx context.Context) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, Python(), filepath.Join(root, "tests", "conformance", "harness.py"), "tiny-model")
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("testserver: building the tiny model with %s: %w", Python(), err)
	}
	return strings.TrimSpace(string(out)), nil
}

// ProfileModels are the --model specs of a profile of the conformance scenario ("" = the
// top-level ones), placeholders (${TINY_MODEL_DIR}, ${SMOLLM2_GGUF}) filled in by
// tests/conformance/harness.py.
func ProfileModels(ctx context.Context, profile string) ([]string, error) {
	if profile == "" {
		return ScenarioModels(ctx)
	}
	root, err := RepoRoot()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, Python(), filepath.Join(root, "tests", "conformance", "harness.py"), "models", "--profile", profile)
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("testserver: the models of profile %q (harness.py with %s): %w", profile, Python(), err)
	}
	return strings.Fields(strings.TrimSpace(string(out))), nil
}

// ScenarioModels are the --model specs the conformance scenario needs.
func ScenarioModels(ctx context.Context) ([]string, error) {
	path, err := ScenarioPath()
	if err != nil {
		return nil, err
	}
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var sc struct {
		ServerModels []string `json:"server_models"`
	}
	if err := json.Unmarshal(raw, &sc); err != nil {
		return nil, fmt.Errorf("testserver: %s: %w", path, err)
	}
	tiny := ""
	out := make([]string, 0, len(sc.ServerModels))
	for _, s := range sc.ServerModels {
		if strings.Contains(s, "${TINY_MODEL_DIR}") {
			if tiny == "" {
				if tiny, err = TinyModelDir(ctx); err != nil {
					return nil, err
				}
			}
			s = strings.ReplaceAll(s, "${TINY_MODEL_DIR}", tiny)
		}
		out = append(out, s)
	}
	return out, nil
}

// Server is a running ferrum-service subprocess.
type Server struct {
	Target  string
	LogPath string
	cmd     *exec.Cmd
	done    chan struct{}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// Start runs `ferrum-service serve` with models on a free loopback port and waits (up to 2 minutes,
// or ctx) until its health check says SERVING.
func Start(ctx context.Context, models []string, extraArgs ...string) (*Server, error) {
	return StartDialing(ctx, models, nil, extraArgs...)
}

// StartDialing is Start for a server that needs dial options to be reached (TLS, a token): its
// readiness check dials with opts.
func StartDialing(ctx context.Context, models []string, opts []ferrum.Option, extraArgs ...string) (*Server, error) {
	base, err := ServerCommand()
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	args := append([]string{}, base[1:]...)
	args = append(args, "serve", "--host", "127.0.0.1", "--port", strconv.Itoa(port), "--metrics-port", "0", "--log-format", "json")
	for _, m := range models {
		args = append(args, "--model", m)
	}
	args = append(args, extraArgs...)
	logf, err := os.CreateTemp("", fmt.Sprintf("ferrum-go-server-%d-*.log", port))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(base[0], args...)
	if root, err := RepoRoot(); err == nil {
		cmd.Dir = root
	}
	cmd.Env = append(os.Environ(), "HF_HUB_OFFLINE=1", "PYTHONUNBUFFERED=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = procAttr()
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("testserver: start %s: %w", base[0], err)
	}
	s := &Server{Target: fmt.Sprintf("127.0.0.1:%d", port), LogPath: logf.Name(), cmd: cmd, done: make(chan struct{})}
	go func() { _ = cmd.Wait(); logf.Close(); close(s.done) }()

	c, err := ferrum.Dial(s.Target, opts...)
	if err != nil {
		s.Stop()
		return nil, err
	}
	defer c.Close()
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	ready := make(chan error, 1)
	go func() { ready <- c.WaitReady(wctx) }()
	select {
	case err := <-ready:
		if err != nil {
			s.Stop()
			return nil, fmt.Errorf("testserver: %w\n%s", err, s.LogTail(4000))
		}
		return s, nil
	case <-s.done:
		return nil, fmt.Errorf("testserver: server exited (%v) before SERVING:\n%s", cmd.ProcessState, s.LogTail(4000))
	}
}

// LogTail is the last n bytes of the server's log.
func (s *Server) LogTail(n int) string {
	b, _ := os.ReadFile(s.LogPath)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// Stop sends SIGTERM to the server's process group, then SIGKILL after 15 s.
func (s *Server) Stop() {
	select {
	case <-s.done:
		return
	default:
	}
	pgid := -s.cmd.Process.Pid
	_ = syscall.Kill(pgid, syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(15 * time.Second):
		_ = syscall.Kill(pgid, syscall.SIGKILL)
		<-s.done
	}
}

// harness runs tests/conformance/harness.py with args and returns its output.
func harness(ctx context.Context, args ...string) (string, error) {
	root, err := RepoRoot()
	if err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, Python(), append([]string{filepath.Join(root, "tests", "conformance", "harness.py")}, args...)...)
	cmd.Dir = root
	cmd.Stderr = os.Stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("testserver: harness.py %s (with %s): %w", strings.Join(args, " "), Python(), err)
	}
	return string(out), nil
}

// ProfileVars are the variables a runner seeds for a profile of the scenario ("" = the top-level
// ones), placeholders (${TINY_LORA_DIR}, ...) filled in by the harness. Numbers are json.Number.
func ProfileVars(ctx context.Context, profile string) (map[string]any, error) {
	out, err := harness(ctx, "vars", "--profile", profile)
	if err != nil {
		return nil, err
	}
	dec := json.NewDecoder(strings.NewReader(out))
	dec.UseNumber()
	vars := map[string]any{}
	if err := dec.Decode(&vars); err != nil {
		return nil, fmt.Errorf("testserver: harness vars: %w", err)
	}
	return vars, nil
}

// ServerArgs are the extra arguments of every scenario server of a profile (server_args).
func ServerArgs(ctx context.Context, profile string) ([]string, error) {
	out, err := harness(ctx, "server-args", "--profile", profile)
	return strings.Fields(out), err
}

// PeerArgs are the extra arguments of a profile's peer (server_args, then peer.extra_args).
func PeerArgs(ctx context.Context, profile string) ([]string, error) {
	out, err := harness(ctx, "peer-args", "--profile", profile)
	return strings.Fields(out), err
}

// StartScenario starts a profile's two fresh servers: the main one and the peer of the KV
// handoff steps. Stop both when done.
func StartScenario(ctx context.Context, profile string) (main, peer *Server, err error) {
	models, err := ProfileModels(ctx, profile)
	if err != nil {
		return nil, nil, err
	}
	margs, err := ServerArgs(ctx, profile)
	if err != nil {
		return nil, nil, err
	}
	pargs, err := PeerArgs(ctx, profile)
	if err != nil {
		return nil, nil, err
	}
	if main, err = Start(ctx, models, margs...); err != nil {
		return nil, nil, err
	}
	if peer, err = Start(ctx, models, pargs...); err != nil {
		main.Stop()
		return nil, nil, err
	}
	return main, peer, nil
}

// Kill ends the server at once (SIGKILL), as a crash would.
func (s *Server) Kill() {
	select {
	case <-s.done:
		return
	default:
	}
	_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
	<-s.done
}

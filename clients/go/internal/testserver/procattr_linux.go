//go:build linux

package testserver

import "syscall"

// The server gets its own process group (so it is stopped with everything it spawned) and is
// killed if this process dies first (a `go test` timeout, a SIGKILL), so no server outlives a run.
func procAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}

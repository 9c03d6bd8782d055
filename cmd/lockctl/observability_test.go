//go:build unix

package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// freeAddr returns a 127.0.0.1 address with a port free now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// httpGet returns the status and body of http://addr+path, within
// testTimeout (t fails when nothing answers).
func httpGet(t *testing.T, addr, path string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// --metrics-addr serves the session's metrics over HTTP while the command
// runs; --log-level debug logs the hold's state changes on stderr.
func TestRunMetricsAndLogs(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	held, release := filepath.Join(dir, "held"), filepath.Join(dir, "release")
	addr := freeAddr(t)
	p := start(t, "run", "--metrics-addr", addr, "--log-level", "debug", name, "--",
		"sh", "-c", fmt.Sprintf("echo x > %q; %s", held, waitFor(release)))
	readFile(t, held) // the command runs: the hold was taken
	code, body := httpGet(t, addr, "/metrics")
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `etcdsync_acquire_wait_seconds_count{kind="mutex"} 1`)
	require.Contains(t, body, "etcdsync_session_deadline_margin_seconds ")
	touch(t, release)
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	logs := p.stderr.String()
	for _, msg := range []string{"session started", "hold acquired", "hold released", "session ended"} {
		require.Contains(t, logs, `msg="etcdsync: `+msg+`"`, "stderr: %s", logs)
	}
	require.Contains(t, logs, "name="+name)
	// The server is gone with lockctl.
	_, err := net.DialTimeout("tcp", addr, time.Second)
	require.Error(t, err)
	noKeys(t, name)
}

// A bad --log-level is a usage error; an address taken is lockctl's own
// error; each one line, nothing left in etcd.
func TestRunObservabilityBadFlags(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	code, p := run(t, "run", "--log-level", "loud", name, "--", "true")
	require.Equal(t, exitUsage, code)
	require.Contains(t, oneLine(t, p.stderr.String()), "--log-level")

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	code, p = run(t, "run", "--metrics-addr", ln.Addr().String(), name, "--", "true")
	require.Equal(t, exitFailure, code)
	require.True(t, strings.Contains(oneLine(t, p.stderr.String()), "--metrics-addr"))
	noKeys(t, name)
}

// --metrics-addr also serves /healthz: 200 "ok: waiting" while a candidate
// waits, 200 "ok: holding KEY REV" while it leads.
func TestElectHealthz(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	aAddr, bAddr := freeAddr(t), freeAddr(t)
	a := start(t, "elect", "--metrics-addr", aAddr, name, "a")
	eventually(t, func() bool { return a.stdout.String() != "" }, "a leads")
	kvs := waitKeys(t, name+"/", 1)
	code, body := httpGet(t, aAddr, "/healthz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, fmt.Sprintf("ok: holding %s %d\n", kvs[0].Key, kvs[0].CreateRevision), body)

	b := start(t, "elect", "--metrics-addr", bAddr, name, "b")
	waitKeys(t, name+"/", 2)
	eventually(t, func() bool { code, body = getHealthMaybe(bAddr); return code != 0 }, "b serves /healthz")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok: waiting\n", body)
	a.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, a.wait(t))
	eventually(t, func() bool { return b.stdout.String() != "" }, "b leads after a handed over")
	b.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, b.wait(t))
	noKeys(t, name)
}

// getHealthMaybe gets /healthz as httpGet does, but returns status 0 while
// nothing listens (for a poll; no failure, no bound of its own).
func getHealthMaybe(addr string) (int, string) {
	resp, err := http.Get("http://" + addr + "/healthz")
	if err != nil {
		return 0, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

//go:build unix

package main

import (
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
)

// signalBound is how soon lockctl must exit after SIGTERM or SIGINT, in
// any phase.
const signalBound = 2 * time.Second * slowdown

// silentEndpoint is a TCP endpoint on 127.0.0.1 that accepts connections
// and never answers: a stopped etcd, a firewall that swallows packets. The
// returned channel closes at the first connection. Everything is closed in
// the test's cleanup.
func silentEndpoint(t *testing.T) (addr string, accepted <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	first := make(chan struct{})
	var (
		mu    sync.Mutex
		conns []net.Conn
		once  sync.Once
		done  = make(chan struct{})
	)
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			once.Do(func() { close(first) })
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	return ln.Addr().String(), first
}

// terminate sends p SIGTERM and checks that it exits with 143 within
// signalBound, saying in one line what it was doing; it returns the line.
func terminate(t *testing.T, p *ctl, doing string) string {
	t.Helper()
	sent := time.Now()
	p.signal(t, syscall.SIGTERM)
	code := p.wait(t)
	took := p.ended.Sub(sent)
	t.Logf("exit %d %v after SIGTERM: %s", code, took, p.stderr.String())
	require.Equal(t, exitSignal+int(syscall.SIGTERM), code, "stderr: %s", p.stderr.String())
	require.Less(t, took, signalBound)
	line := oneLine(t, p.stderr.String())
	require.Contains(t, line, "interrupted by SIGTERM "+doing)
	return line
}

// SIGTERM ends lockctl promptly in every phase that it can be caught in
// for sure (running the command is TestRunSignalsReachGroup): connecting to
// an endpoint that never answers, waiting for the lock, starting the
// command (its guard slow to report), and releasing the lock over a link
// that has gone silent (the key is then left to its lease's expiry).
func TestSignalEndsEveryPhase(t *testing.T) {
	t.Parallel()
	t.Run("connecting", func(t *testing.T) {
		t.Parallel()
		addr, accepted := silentEndpoint(t)
		p := start(t, "--endpoints", addr, "--dial-timeout", "30s", "run", uniqueName(t), "--", "true")
		select {
		case <-accepted:
		case <-time.After(testTimeout):
			t.Fatalf("lockctl did not connect: %s", p.stderr.String())
		}
		require.Contains(t, terminate(t, p, "while connecting to etcd at "+addr), addr)
	})
	t.Run("waiting", func(t *testing.T) {
		t.Parallel()
		name, dir := uniqueName(t), t.TempDir()
		holder, release := holding(t, dir, "run", name)
		p := start(t, "run", "--quiet", name, "--", "touch", filepath.Join(dir, "ran"))
		waitKeys(t, name+"/", 2)
		terminate(t, p, "while waiting for the lock on "+name)
		waitKeys(t, name+"/", 1)
		touch(t, release)
		require.Equal(t, 0, holder.wait(t))
		require.NoFileExists(t, filepath.Join(dir, "ran"))
		noKeys(t, name)
	})
	t.Run("starting", func(t *testing.T) {
		t.Parallel()
		name, dir := uniqueName(t), t.TempDir()
		self := ownLockctl(t, dir)
		holder, release := holding(t, dir, "run", name)
		guarding := filepath.Join(dir, "guarding")
		p := startWith(t, opts{bin: self}, "run", "--quiet", name, "--", "touch", filepath.Join(dir, "ran"))
		waitKeys(t, name+"/", 2)
		replaceGuard(t, self, fmt.Sprintf("#!/bin/sh\necho x > %q\nexec sleep 60\n", guarding), release, holder)
		readFile(t, guarding)
		terminate(t, p, "while starting touch")
		require.NoFileExists(t, filepath.Join(dir, "ran"))
		lockFree(t, name)
	})
	t.Run("releasing", func(t *testing.T) {
		etcdtest.SkipSlowInShort(t) // its key is left to expire
		t.Parallel()
		name, dir := uniqueName(t), t.TempDir()
		pidfile, release := filepath.Join(dir, "pid"), filepath.Join(dir, "release")
		proxy := etcdtest.NewProxy(t, strings.TrimPrefix(endpoint, "http://"))
		// A TTL long enough that the session outlives the test's SIGTERM:
		// the release is not ended by the loss of the lease.
		p := start(t, "--endpoints", proxy.Endpoint(), "run", "--ttl", "10s", name, "--", "sh", "-c",
			fmt.Sprintf(`echo $$ > %q.tmp && mv %q.tmp %q; %s`, pidfile, pidfile, pidfile, waitFor(release)))
		pid, err := strconv.Atoi(strings.TrimSpace(readFile(t, pidfile)))
		require.NoError(t, err)
		proxy.Blackhole(true)
		t.Cleanup(func() { proxy.Blackhole(false) })
		touch(t, release)
		eventually(t, func() bool { return gone(pid) }, "the command exits")
		line := terminate(t, p, "while releasing "+name+"/")
		require.Contains(t, line, "left to expire on etcd")
		proxy.Blackhole(false)
		waitKeys(t, name+"/", 0) // the lease expires on the server
	})
}

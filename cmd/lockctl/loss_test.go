//go:build unix

package main

import (
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// trapTerm is a script that writes started, then loops until SIGTERM,
// which it records in termed before exiting 0. Its stderr is discarded
// (sh reports the killed sleep), so that lockctl's alone is checked.
func trapTerm(started, termed string) string {
	return fmt.Sprintf(`exec 2>/dev/null; trap 'echo term > %q; exit 0' TERM; echo x > %q; i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; exit 99`, termed, started)
}

// revokeHolder revokes the lease of the only key under name, as an admin
// would, and returns when the revoke committed.
func revokeHolder(t *testing.T, name string) {
	t.Helper()
	kvs := waitKeys(t, name+"/", 1)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	_, err := admin.Revoke(ctx, clientv3.LeaseID(kvs[0].Lease))
	require.NoError(t, err)
}

// A lease revoked by an admin ends the hold: the command's group gets
// SIGTERM, lockctl exits 143 and says why in one line.
func TestLossRevokedLease(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	started, termed := filepath.Join(dir, "started"), filepath.Join(dir, "termed")
	p := start(t, "run", name, "--", "sh", "-c", trapTerm(started, termed))
	readFile(t, started)
	revokeHolder(t, name)
	require.Equal(t, "term\n", readFile(t, termed))
	require.Equal(t, 143, p.wait(t), "stderr: %s", p.stderr.String())
	line := oneLine(t, p.stderr.String())
	require.Contains(t, line, "lost the lock on "+name)
	require.Contains(t, line, "SIGTERM")
	noKeys(t, name)
}

// A command that ignores SIGTERM is killed after --grace: 137.
func TestLossGraceKill(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	started := filepath.Join(dir, "started")
	script := fmt.Sprintf(`exec 2>/dev/null; trap '' TERM; echo x > %q; i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; exit 99`, started)
	p := start(t, "run", "--grace", "300ms", name, "--", "sh", "-c", script)
	readFile(t, started)
	revoked := time.Now()
	revokeHolder(t, name)
	require.Equal(t, 137, p.wait(t), "stderr: %s", p.stderr.String())
	require.GreaterOrEqual(t, time.Since(revoked), 300*time.Millisecond, "SIGKILL before --grace")
	require.Contains(t, oneLine(t, p.stderr.String()), "lost the lock on "+name)
	noKeys(t, name)
}

// With etcd unreachable (a blackholed link), the hold ends at the session's
// local deadline, within the TTL of the last acknowledged keepalive, and so
// does the command: etcd may give the lock to another from that instant, so
// its group gets SIGKILL then (by lockctl and by its guard), not when the
// server gets around to it (consul#9788). lockctl exits 137 saying contact
// was lost.
func TestLossBlackhole(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	started, pidfile := filepath.Join(dir, "started"), filepath.Join(dir, "pid")
	proxy := etcdtest.NewProxy(t, strings.TrimPrefix(endpoint, "http://"))
	const ttl = 2 * time.Second
	script := fmt.Sprintf(`echo $$ > %q.tmp && mv %q.tmp %q; %s`, pidfile, pidfile, pidfile, trapTerm(started, filepath.Join(dir, "termed")))
	p := start(t, "--endpoints", proxy.Endpoint(), "run", "--ttl", ttl.String(), name, "--", "sh", "-c", script)
	readFile(t, started)
	pid, err := strconv.Atoi(strings.TrimSpace(readFile(t, pidfile)))
	require.NoError(t, err)
	cut := time.Now()
	proxy.Blackhole(true)
	t.Cleanup(func() { proxy.Blackhole(false) })
	eventually(t, func() bool { return gone(pid) }, "the command ends")
	elapsed := time.Since(cut)
	t.Logf("the command ended %v after the link was cut (TTL %v)", elapsed, ttl)
	require.LessOrEqual(t, elapsed, ttl+1500*time.Millisecond, "the command ended %v after the link was cut; the TTL is %v", elapsed, ttl)
	require.Equal(t, 137, p.wait(t), "stderr: %s", p.stderr.String())
	line := oneLine(t, p.stderr.String())
	require.Contains(t, line, "lost the lock on "+name)
	require.Contains(t, line, "lost contact")
	require.Contains(t, line, "SIGKILL")
	// The server expires the lease by itself.
	waitKeys(t, name+"/", 0) // the server expires the lease
}

// A slow but working link is not a lost one: with replies delayed by half
// the TTL, keepalives are still acknowledged within the TTL of their
// sending, so neither lockctl nor its guard stops the command, which ends
// by itself with its own status.
func TestSlowLinkKeepsCommand(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	started, release := filepath.Join(dir, "started"), filepath.Join(dir, "release")
	proxy := etcdtest.NewProxy(t, strings.TrimPrefix(endpoint, "http://"))
	const ttl = 2 * time.Second
	p := start(t, "--endpoints", proxy.Endpoint(), "run", "--ttl", ttl.String(), name, "--", "sh", "-c",
		fmt.Sprintf(`echo x > %q; %s; exit 7`, started, waitFor(release)))
	readFile(t, started)
	proxy.SetLatency(ttl / 2)
	// Three TTLs at half-TTL latency: the hold would have ended twice over
	// if a slow acknowledgement counted as none.
	select {
	case <-p.done:
		t.Fatalf("lockctl ended on a slow link: %s", p.stderr.String())
	case <-time.After(3 * ttl):
	}
	require.Len(t, keys(t, name+"/"), 1, "the hold lives")
	require.True(t, p.running(), "lockctl ended: %s", p.stderr.String())
	proxy.SetLatency(0)
	touch(t, release)
	require.Equal(t, 7, p.wait(t), "stderr: %s", p.stderr.String())
	require.Empty(t, p.stderr.String())
	noKeys(t, name)
}

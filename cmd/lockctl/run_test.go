//go:build unix

package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// Without ETCDCTL_ENDPOINTS, lockctl reaches the endpoints the examples'
// ETCD_ENDPOINTS names (its default, 127.0.0.1:2379, has no etcd here).
func TestEndpointsFromExamplesVariable(t *testing.T) {
	t.Parallel()
	p := startWith(t, opts{env: []string{"ETCDCTL_ENDPOINTS=", "ETCD_ENDPOINTS=" + endpoint, "ETCDCTL_DIAL_TIMEOUT=2s"}}, "run", uniqueName(t), "--", "true")
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
}

// A name with a trailing slash is a lock apart from the name without it:
// lockctl says so on stderr, and runs the command.
func TestTrailingSlashWarned(t *testing.T) {
	t.Parallel()
	name := uniqueName(t) + "/"
	p := start(t, "run", name, "--", "true")
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	require.Contains(t, p.stderr.String(), "warning: \""+name+"\" ends in \"/\"")
}

// The child sees the hold's variables: the key, its create revision (the
// fencing token, also as etcdctl's ETCD_LOCK_REV), the lease; after the run
// the key and the lease are gone.
func TestRunEnv(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	env, release := filepath.Join(dir, "env"), filepath.Join(dir, "release")
	script := fmt.Sprintf(`printf '%%s\n' "$ETCDSYNC_NAME" "$ETCDSYNC_KEY" "$ETCDSYNC_REV" "$ETCDSYNC_LEASE" "$ETCD_LOCK_KEY" "$ETCD_LOCK_REV" > %q.tmp && mv %q.tmp %q; %s`,
		env, env, env, waitFor(release))
	// ETCDCTL_ENDPOINTS points nowhere: --endpoints overrides it.
	p := startWith(t, opts{env: []string{"ETCDCTL_ENDPOINTS=127.0.0.1:1"}}, "--endpoints", endpoint, "run", name, "--", "sh", "-c", script)
	vars := strings.Split(strings.TrimSpace(readFile(t, env)), "\n")
	require.Len(t, vars, 6)
	kvs := keys(t, name+"/")
	require.Len(t, kvs, 1)
	kv := kvs[0]
	lease := strconv.FormatInt(kv.Lease, 16)
	require.Equal(t, name, vars[0], "ETCDSYNC_NAME")
	require.Equal(t, string(kv.Key), vars[1], "ETCDSYNC_KEY")
	require.Equal(t, name+"/"+lease, vars[1], "the key is NAME/<lease-hex>")
	require.Equal(t, strconv.FormatInt(kv.CreateRevision, 10), vars[2], "ETCDSYNC_REV is the key's create revision")
	require.Equal(t, lease, vars[3], "ETCDSYNC_LEASE")
	require.Equal(t, vars[1], vars[4], "ETCD_LOCK_KEY")
	require.Equal(t, vars[2], vars[5], "ETCD_LOCK_REV")

	touch(t, release)
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	require.Empty(t, p.stderr.String())
	noKeys(t, name)
	leaseGone(t, lease)
}

// With several names lockctl holds every one (one key each, one create
// revision for all, each saying who holds), the command sees every name and
// key, --try on any of them is refused meanwhile, and nothing is left after.
func TestRunSeveralNames(t *testing.T) {
	t.Parallel()
	base, dir := uniqueName(t), t.TempDir()
	a, b := base+"/a", base+"/b"
	env, release := filepath.Join(dir, "env"), filepath.Join(dir, "release")
	script := fmt.Sprintf(`printf '%%s\n' "$ETCDSYNC_NAMES" "$ETCDSYNC_KEYS" "$ETCDSYNC_REV" "$ETCDSYNC_NAME" > %q.tmp && mv %q.tmp %q; %s`,
		env, env, env, waitFor(release))
	p := start(t, "run", b, a, b, "--", "sh", "-c", script)
	vars := strings.Split(strings.TrimSpace(readFile(t, env)), "\n")
	require.Len(t, vars, 6, "names, keys (two lines each), revision, first name: %q", vars)
	ka, kb := keys(t, a+"/"), keys(t, b+"/")
	require.Len(t, ka, 1)
	require.Len(t, kb, 1)
	require.Equal(t, ka[0].CreateRevision, kb[0].CreateRevision, "one create revision for both keys")
	host, err := os.Hostname()
	require.NoError(t, err)
	who := fmt.Sprintf("lockctl host=%s pid=%d", host, p.cmd.Process.Pid)
	require.Equal(t, who, string(ka[0].Value), "who holds, on every key")
	require.Equal(t, who, string(kb[0].Value), "who holds, on every key")
	require.Equal(t, []string{a, b, string(ka[0].Key), string(kb[0].Key), strconv.FormatInt(ka[0].CreateRevision, 10), a}, vars)

	code, q := run(t, "run", "--try", b, "--", "true")
	require.Equal(t, exitHeld, code, "stderr: %s", q.stderr.String())
	code, q = run(t, "run", "--try", a, base+"/c", "--", "true")
	require.Equal(t, exitHeld, code, "stderr: %s", q.stderr.String())
	noKeys(t, base+"/c")

	touch(t, release)
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	noKeys(t, a)
	noKeys(t, b)
}

// The command's exit status and stdio pass through; a command that dies by
// a signal is 128+N; a missing command is 127 with nothing taken.
func TestRunExitStatus(t *testing.T) {
	t.Parallel()
	name := uniqueName(t)
	for _, tc := range []struct {
		args  []string
		stdin string
		code  int
		out   string
	}{
		{args: []string{"sh", "-c", "echo out; echo err >&2; exit 7"}, code: 7, out: "out\n"},
		{args: []string{"true"}, code: 0},
		{args: []string{"cat"}, stdin: "from stdin\n", code: 0, out: "from stdin\n"},
		{args: []string{"sh", "-c", "kill -USR1 $$"}, code: 128 + int(syscall.SIGUSR1)},
	} {
		p := startWith(t, opts{stdin: tc.stdin}, append([]string{"run", name, "--"}, tc.args...)...)
		require.Equal(t, tc.code, p.wait(t), "%q: stderr %s", tc.args, p.stderr.String())
		require.Equal(t, tc.out, p.stdout.String(), "%q", tc.args)
		if tc.code == 7 {
			require.Equal(t, "err\n", p.stderr.String(), "the command's stderr, nothing of lockctl's")
		}
		noKeys(t, name)
	}

	code, p := run(t, "run", name, "--", "no-such-command-lockctl-test")
	require.Equal(t, exitNotFound, code)
	require.Contains(t, oneLine(t, p.stderr.String()), "no-such-command-lockctl-test")
	noKeys(t, name)
}

// SIGTERM and SIGINT to lockctl reach the command's whole process group:
// a grandchild does not outlive the run (consul#2999). sh leaves SIGINT
// ignored in its background jobs, so after SIGINT the grandchild is stopped
// by lockctl as a process left in the group.
func TestRunSignalsReachGroup(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sig  syscall.Signal
		code int
	}{{syscall.SIGTERM, 143}, {syscall.SIGINT, 130}} {
		t.Run(tc.sig.String(), func(t *testing.T) {
			t.Parallel()
			name, dir := uniqueName(t), t.TempDir()
			pidfile := filepath.Join(dir, "pid")
			p := start(t, "run", "--grace", "2s", name, "--", "sh", "-c", fmt.Sprintf(`sleep 60 & echo $! > %q.tmp && mv %q.tmp %q; wait`, pidfile, pidfile, pidfile))
			pid, err := strconv.Atoi(strings.TrimSpace(readFile(t, pidfile)))
			require.NoError(t, err)
			t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
			require.False(t, gone(pid))
			p.signal(t, tc.sig)
			require.Equal(t, tc.code, p.wait(t), "stderr: %s", p.stderr.String())
			require.Empty(t, p.stderr.String())
			require.True(t, gone(pid), "the grandchild %d outlived lockctl", pid)
			noKeys(t, name)
		})
	}
}

// A command that exits leaving processes in its group does not release the
// lock under them: they get SIGTERM, and SIGKILL after --grace if they
// ignore it; the exit status stays the command's.
func TestRunLeftoverGroup(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	pidfile := filepath.Join(dir, "pid")
	script := fmt.Sprintf(`trap '' TERM; sleep 60 & echo $! > %q.tmp && mv %q.tmp %q; exit 3`, pidfile, pidfile, pidfile)
	p := start(t, "run", "--grace", "1s", name, "--", "sh", "-c", script)
	pid, err := strconv.Atoi(strings.TrimSpace(readFile(t, pidfile)))
	require.NoError(t, err)
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	eventually(t, func() bool { return strings.Contains(p.stderr.String(), "left processes") }, "lockctl sees the leftover")
	require.Len(t, keys(t, name+"/"), 1, "the lock is held while the leftover runs")
	require.Equal(t, 3, p.wait(t), "stderr: %s", p.stderr.String())
	require.GreaterOrEqual(t, p.ended.Sub(p.started), time.Second, "SIGKILL before --grace")
	require.Contains(t, oneLine(t, p.stderr.String()), "left processes in its group")
	require.True(t, gone(pid), "the grandchild %d outlived lockctl", pid)
	noKeys(t, name)
}

// Runs on one name never overlap: each child checks that it is alone (an
// atomic mkdir) and logs its start and end; the log never interleaves.
func TestRunNoOverlap(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	log, inside := filepath.Join(dir, "log"), filepath.Join(dir, "inside")
	const n = 4
	var ps []*ctl
	for i := 0; i < n; i++ {
		script := fmt.Sprintf(`echo "start %d" >> %q; mkdir %q || exit 99; sleep 0.1; rmdir %q; echo "end %d" >> %q`, i, log, inside, inside, i, log)
		ps = append(ps, start(t, "run", name, "--", "sh", "-c", script))
	}
	for _, p := range ps {
		require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	}
	b, err := os.ReadFile(log)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	require.Len(t, lines, 2*n)
	for i := 0; i < len(lines); i += 2 {
		id := strings.TrimPrefix(lines[i], "start ")
		require.NotEqual(t, lines[i], id, "line %d: %q", i, lines[i])
		require.Equal(t, "end "+id, lines[i+1], "runs overlapped: %q", lines)
	}
	noKeys(t, name)
}

// --try exits 75 at once while another holds, writing nothing; --timeout
// ends the wait with 124 and a message (the only one, with --quiet),
// leaving no key.
func TestRunTryAndTimeout(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	holder, release := holding(t, dir, "run", name)
	held := keys(t, name+"/")
	require.Len(t, held, 1)

	begin := time.Now()
	code, p := run(t, "run", "--try", name, "--", "touch", filepath.Join(dir, "ran"))
	require.Equal(t, exitHeld, code, "stderr: %s", p.stderr.String())
	require.Less(t, time.Since(begin), 5*time.Second)
	require.Contains(t, oneLine(t, p.stderr.String()), "held")
	require.NoFileExists(t, filepath.Join(dir, "ran"))

	begin = time.Now()
	code, p = run(t, "run", "--quiet", "--timeout", "500ms", name, "--", "touch", filepath.Join(dir, "ran"))
	require.Equal(t, exitTimeout, code, "stderr: %s", p.stderr.String())
	require.GreaterOrEqual(t, time.Since(begin), 500*time.Millisecond)
	require.Contains(t, oneLine(t, p.stderr.String()), "--timeout 500ms passed")
	require.NoFileExists(t, filepath.Join(dir, "ran"))
	require.Equal(t, held, keys(t, name+"/"), "only the holder's key")

	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	code, p = run(t, "run", "--try", name, "--", "touch", filepath.Join(dir, "ran"))
	require.Equal(t, 0, code, "stderr: %s", p.stderr.String())
	require.FileExists(t, filepath.Join(dir, "ran"))
	noKeys(t, name)
}

// A signal while waiting withdraws the waiter: 128+N, one line after the
// one that said it waits, no key.
func TestRunSignalWhileWaiting(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	holder, release := holding(t, dir, "run", name)
	waiter := start(t, "run", name, "--", "touch", filepath.Join(dir, "ran"))
	waiting := waiter.stderrLine(t, "waiting for the lock on "+name)
	waiter.signal(t, syscall.SIGINT)
	require.Equal(t, 130, waiter.wait(t))
	got := lines(waiter.stderr.String())
	require.Len(t, got, 2, "stderr: %s", waiter.stderr.String())
	require.Equal(t, waiting, got[0])
	require.Contains(t, oneLine(t, got[1]+"\n"), "interrupted")
	waitKeys(t, name+"/", 1)
	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	require.NoFileExists(t, filepath.Join(dir, "ran"))
	noKeys(t, name)
}

// --read holds are shared, --write excludes them, --sem N admits N.
func TestRunReadWriteSem(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	release := filepath.Join(dir, "release")
	r1 := start(t, "run", "--read", name, "--", "sh", "-c", waitFor(release))
	r2 := start(t, "run", "--read", name, "--", "sh", "-c", waitFor(release))
	waitKeys(t, name+"/read/", 2)
	code, p := run(t, "run", "--write", "--try", name, "--", "true")
	require.Equal(t, exitHeld, code, "stderr: %s", p.stderr.String())
	code, p = run(t, "run", "--read", "--try", name, "--", "true")
	require.Equal(t, 0, code, "readers share: %s", p.stderr.String())
	touch(t, release)
	require.Equal(t, 0, r1.wait(t))
	require.Equal(t, 0, r2.wait(t))
	noKeys(t, name)

	sem := name + "-sem"
	os.Remove(release)
	s1 := start(t, "run", "--sem", "2", sem, "--", "sh", "-c", waitFor(release))
	s2 := start(t, "run", "--sem", "2", sem, "--", "sh", "-c", waitFor(release))
	waitKeys(t, sem+"/", 2)
	code, p = run(t, "run", "--sem", "2", "--try", sem, "--", "true")
	require.Equal(t, exitHeld, code, "stderr: %s", p.stderr.String())
	code, p = run(t, "run", "--sem", "3", "--try", sem, "--", "true")
	require.Equal(t, exitFailure, code, "another capacity")
	require.Contains(t, oneLine(t, p.stderr.String()), "capacity")
	touch(t, release)
	require.Equal(t, 0, s1.wait(t))
	require.Equal(t, 0, s2.wait(t))
	noKeys(t, sem)
}

// --namespace puts the lock under the prefix, the same lock a plain client
// takes on the prefixed name; through etcd's gRPC proxy a waiter says that
// it waits and gets the turn when the holder ends, and no key is left.
func TestRunNamespaceAndProxy(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	ns := name + "-ns/"
	proxy := etcdtest.StartGRPCProxy(t, []string{endpoint})
	holder, release := holding(t, dir, "--endpoints", proxy, "--namespace", ns, "run", name)
	require.Len(t, keys(t, ns+name+"/"), 1, "the holder's key, under the namespace")
	require.Empty(t, keys(t, name+"/"), "nothing outside the namespace")

	code, p := run(t, "run", "--try", ns+name, "--", "touch", filepath.Join(dir, "ran"))
	require.Equal(t, exitHeld, code, "a plain client on the prefixed name is excluded; stderr: %s", p.stderr.String())
	waiter := start(t, "--endpoints", proxy, "--namespace", ns, "run", name, "--", "touch", filepath.Join(dir, "ran"))
	waitKeys(t, ns+name+"/", 2)
	// It says so, with the keys as it sees them: without the prefix.
	waiter.stderrLine(t, "waiting for the lock on "+name+": place 1 in the queue, held by "+name+"/")
	require.NoFileExists(t, filepath.Join(dir, "ran"))
	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	require.Equal(t, 0, waiter.wait(t), "stderr: %s", waiter.stderr.String())
	require.FileExists(t, filepath.Join(dir, "ran"))
	noKeys(t, ns+name)
}

// --slack sets how long the lease outlives the TTL: by default the larger of
// 2 s and a tenth of the TTL, 0 turns it off; a negative one is a usage error.
func TestRunSlackIsGrantedWithTheLease(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args    []string
		granted int64
	}{
		{[]string{"--ttl", "3s"}, 5},
		{[]string{"--ttl", "3s", "--slack", "0"}, 3},
		{[]string{"--ttl", "3s", "--slack", "4s", "--lock-delay", "1s"}, 8},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			name := uniqueName(t)
			p, release := holding(t, t.TempDir(), append(tc.args, "run", name)...)
			kvs := waitKeys(t, name+"/", 1)
			ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
			defer cancel()
			resp, err := admin.TimeToLive(ctx, clientv3.LeaseID(kvs[0].Lease))
			require.NoError(t, err)
			require.Equal(t, tc.granted, resp.GrantedTTL)
			touch(t, release)
			require.Equal(t, 0, p.wait(t))
			noKeys(t, name)
		})
	}
	code, p := run(t, "run", "--slack", "-1s", uniqueName(t), "--", "true")
	require.Equal(t, 2, code, p.stderr.String())
}

// run --try A B when B is held (by a Mutex: etcdctl lock's key) exits 75,
// does not run the command, and writes nothing on either name.
func TestRunTrySeveralNamesOneHeldWritesNothing(t *testing.T) {
	t.Parallel()
	base, dir := uniqueName(t), t.TempDir()
	a, b := base+"/a", base+"/b"
	holder, release := holding(t, dir, "run", b)
	held := keys(t, b+"/")
	require.Len(t, held, 1)
	code, p := run(t, "run", "--try", a, b, "--", "touch", filepath.Join(dir, "ran"))
	require.Equal(t, exitHeld, code, "stderr: %s", p.stderr.String())
	require.NoFileExists(t, filepath.Join(dir, "ran"))
	noKeys(t, a)
	after := keys(t, b+"/")
	require.Len(t, after, 1)
	require.Equal(t, held[0].ModRevision, after[0].ModRevision)
	touch(t, release)
	require.Equal(t, 0, holder.wait(t))
	noKeys(t, b)
}

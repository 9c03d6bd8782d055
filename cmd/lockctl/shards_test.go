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

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/sys/unix"
)

// shardScript is a shard's command: it appends "SHARD REV LEASE PID start"
// to log, waits, and on SIGTERM appends the same with "stop" and exits 0.
// It waits in the foreground (a background child forked as the signal
// comes may miss it), and its stderr is discarded (sh reports the killed
// sleep).
func shardScript(log string) string {
	line := fmt.Sprintf(`echo "$ETCDSYNC_SHARD $ETCDSYNC_REV $ETCDSYNC_LEASE $$ %%s" >> %q`, log)
	return fmt.Sprintf(`exec 2>/dev/null; trap '%s; exit 0' TERM; %s; i=0; while [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done; exit 99`,
		fmt.Sprintf(line, "stop"), fmt.Sprintf(line, "start"))
}

// shardCmd is one run of a shard's command, as its lines tell.
type shardCmd struct {
	rev   int64
	lease string
	pid   int
}

// shardLog is the log of the shards' commands, read in order.
type shardLog struct {
	open  map[int]shardCmd // running now, by shard
	runs  []shardCmd       // every start, in order
	stops int
	gones int // runs that ended with the test's "gone" line, not their own "stop"
}

// readShardLog reads log and checks, line by line, that no shard runs on
// two members at once (a start only while the shard's last run stopped),
// that a stop is its run's, and that a shard's revision grows from one
// member to the next. Besides the commands' lines, it reads the test's
// "gone" lines (see markGone): a run still open ends there; one that
// logged its stop first is left as it is.
func readShardLog(t *testing.T, log string) shardLog {
	t.Helper()
	b, err := os.ReadFile(log)
	if os.IsNotExist(err) {
		return shardLog{open: map[int]shardCmd{}}
	}
	require.NoError(t, err)
	l := shardLog{open: map[int]shardCmd{}}
	last := map[int]shardCmd{}
	done := string(b[:strings.LastIndexByte(string(b), '\n')+1]) // a line still being written is read next time
	for _, line := range strings.Split(strings.TrimSuffix(done, "\n"), "\n") {
		if line == "" {
			continue // an empty log (its file made by the shell before its first line)
		}
		f := strings.Fields(line)
		require.Len(t, f, 5, "line %q", line)
		shard, err1 := strconv.Atoi(f[0])
		rev, err2 := strconv.ParseInt(f[1], 10, 64)
		pid, err3 := strconv.Atoi(f[3])
		require.NoError(t, firstNonNil(err1, err2, err3), "line %q", line)
		r := shardCmd{rev: rev, lease: f[2], pid: pid}
		switch f[4] {
		case "start":
			o, running := l.open[shard]
			require.False(t, running, "shard %d started (%q) while %+v ran: two at once\n%s", shard, line, o, b)
			if p, ok := last[shard]; ok && p.lease != r.lease {
				require.Greater(t, r.rev, p.rev, "shard %d: the next member's revision (%q)\n%s", shard, line, b)
			}
			l.open[shard], last[shard] = r, r
			l.runs = append(l.runs, r)
		case "stop":
			require.Equal(t, l.open[shard], r, "shard %d: a stop (%q) of another run\n%s", shard, line, b)
			delete(l.open, shard)
			l.stops++
		case "gone":
			if o, running := l.open[shard]; running && o == r {
				delete(l.open, shard)
				l.gones++
				break
			}
			require.Equal(t, last[shard], r, "shard %d: a gone line (%q) of another run\n%s", shard, line, b)
		default:
			t.Fatalf("line %q", line)
		}
	}
	return l
}

// perLease counts the running shards of each member (lease).
func (l shardLog) perLease() map[string]int {
	n := map[string]int{}
	for _, r := range l.open {
		n[r.lease]++
	}
	return n
}

// waitShards waits until the log shows the shards running as want says
// (a member's lease -> how many it runs; "" stands for any one other
// member) and returns the log then.
func waitShards(t *testing.T, log string, want func(map[string]int) bool, what string) shardLog {
	t.Helper()
	var l shardLog
	eventually(t, func() bool { l = readShardLog(t, log); return want(l.perLease()) }, "%s (log: %+v)", what, &l)
	return l
}

// onlyLease is a want for waitShards: every shard on lease (any one lease
// when lease is ""), and n of them.
func onlyLease(lease *string, n int) func(map[string]int) bool {
	return func(m map[string]int) bool {
		if len(m) != 1 {
			return false
		}
		for l, k := range m {
			if *lease == "" {
				*lease = l
			}
			return l == *lease && k == n
		}
		return false
	}
}

// startShards starts a member: lockctl shards with args, NAME, N, and the
// script that logs to log.
func startShards(t *testing.T, log, name string, n int, args ...string) *ctl {
	t.Helper()
	return start(t, append(append([]string{"shards"}, args...), name, strconv.Itoa(n), "--", "sh", "-c", shardScript(log))...)
}

// checkOwners checks that ShardOwners shows each running shard's holder:
// the lease the log shows, at the revision it shows.
func checkOwners(t *testing.T, name string, n int, l shardLog) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	owners, err := etcdsync.ShardOwners(ctx, admin, name, n)
	require.NoError(t, err)
	for i, o := range owners {
		r, ok := l.open[i]
		require.True(t, ok, "shard %d not running", i)
		require.Equal(t, r.lease, strconv.FormatInt(int64(o.Lease), 16), "shard %d's holder", i)
		require.Equal(t, r.rev, o.Rev, "shard %d's revision", i)
	}
}

// Two members share 4 shards, 2 each, and never run one at once: the first
// runs all 4, the second's join moves 2 (their commands get SIGTERM before
// the second starts them), the second's SIGTERM moves them back, and the
// first's SIGTERM stops its commands and leaves nothing in etcd. Both exit
// 0 and say on stderr when each shard's command starts and stops.
func TestShardsSpreadOverMembers(t *testing.T) {
	t.Parallel()
	name, log := uniqueName(t), filepath.Join(t.TempDir(), "log")
	a := startShards(t, log, name, 4)
	var la, lb string
	waitShards(t, log, onlyLease(&la, 4), "the first member runs all 4")

	b := startShards(t, log, name, 4)
	l := waitShards(t, log, func(m map[string]int) bool {
		for lease, k := range m {
			if lease != la {
				lb = lease
			}
			if k != 2 {
				return false
			}
		}
		return len(m) == 2
	}, "2 shards on each member")
	checkOwners(t, name, 4, l)
	for i, r := range l.open { // lockctl says so once the guard reports, maybe after the command's first line
		on := a
		if r.lease == lb {
			on = b
		}
		want := fmt.Sprintf("lockctl: shard %d of %s: running, revision %d\n", i, name, r.rev)
		eventually(t, func() bool { return strings.Contains(on.stderr.String(), want) }, "%q on stderr", want)
	}
	require.Equal(t, 2, strings.Count(a.stderr.String(), ": the shard moves to another member; the command's group got SIGTERM"), "stderr: %s", a.stderr.String())

	b.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
	require.Equal(t, 2, strings.Count(b.stderr.String(), "lockctl is stopping (interrupted by SIGTERM)"), "stderr: %s", b.stderr.String())
	l = waitShards(t, log, onlyLease(&la, 4), "the first member runs all 4 again")
	checkOwners(t, name, 4, l)

	a.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, a.wait(t), "stderr: %s", a.stderr.String())
	l = readShardLog(t, log)
	require.Empty(t, l.open, "commands still running")
	require.Len(t, l.runs, 8, "4 runs, 2 moved there and back")
	for _, r := range l.runs {
		require.True(t, gone(r.pid), "command %d left running", r.pid)
	}
	noKeys(t, name)
	leaseGone(t, la)
	leaseGone(t, lb)
}

// markGone appends a "gone" line to log for each run of runs (by shard)
// whose command has ended, and drops it from runs; it returns how many are
// left. A command killed with SIGKILL logs no stop: the line, written once
// the test sees its process gone, stands for it, so that readShardLog finds
// a start of its shard elsewhere before it as two runs at once.
func markGone(t *testing.T, log string, runs map[int]shardCmd) int {
	t.Helper()
	for i, r := range runs {
		if !gone(r.pid) {
			continue
		}
		f, err := os.OpenFile(log, os.O_WRONLY|os.O_APPEND, 0)
		require.NoError(t, err)
		_, err = fmt.Fprintf(f, "%d %d %s %d gone\n", i, r.rev, r.lease, r.pid) // one write: whole among the commands' lines
		require.NoError(t, firstNonNil(err, f.Close()))
		delete(runs, i)
	}
	return len(runs)
}

// A member killed with SIGKILL or frozen with SIGSTOP: its guards end its
// commands, and the other member takes its shards once its lease expires
// (the TTL plus the slack), never while they ran; then it runs all 4.
// Killed, the member's guards send its commands SIGTERM at once (they log
// their stop). Frozen, its guards kill its commands' groups (SIGKILL, no
// stop logged) at the session's deadline, before the lease can expire; once
// continued, the member runs no shard again, and exits 137 (contact lost:
// its session's deadline passed) saying so in its last line, while the
// other goes on with all 4.
func TestShardsFailoverAfterKill(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	const ttl, slack = 2 * time.Second, 2 * time.Second // --slack's default for a TTL of 2s
	for _, tc := range []struct {
		sig  syscall.Signal
		term bool // the guards' SIGTERM reaches the commands (else SIGKILL at the deadline)
	}{
		{syscall.SIGKILL, true},
		{syscall.SIGSTOP, false},
	} {
		t.Run(unix.SignalName(tc.sig), func(t *testing.T) {
			t.Parallel()
			name, log := uniqueName(t), filepath.Join(t.TempDir(), "log")
			a := startShards(t, log, name, 4, "--ttl", "2s")
			var la string
			waitShards(t, log, onlyLease(&la, 4), "the first member runs all 4")
			b := startShards(t, log, name, 4, "--ttl", "2s")
			l := waitShards(t, log, func(m map[string]int) bool { return len(m) == 2 && m[la] == 2 }, "2 shards on each member")
			if tc.sig == syscall.SIGSTOP {
				t.Cleanup(func() { a.cmd.Process.Signal(syscall.SIGCONT) }) // nothing left stopped
			}
			left := map[int]shardCmd{} // the first member's commands still running
			for i, r := range l.open {
				if r.lease == la {
					left[i] = r
				}
			}

			a.signal(t, tc.sig)
			signalled := time.Now()
			var lb string
			var ended time.Duration // from the signal until the first member's commands had all ended
			eventually(t, func() bool {
				if len(left) > 0 && markGone(t, log, left) == 0 {
					ended = time.Since(signalled)
				}
				l = readShardLog(t, log)
				for lease := range l.perLease() {
					if lease != la {
						lb = lease
					}
				}
				return onlyLease(&lb, 4)(l.perLease())
			}, "the second member runs all 4 (log: %+v)", &l)
			took := time.Since(signalled)
			require.Empty(t, left, "the first member's commands still running")
			t.Logf("the first member's commands ended %v, and the second member ran all 4 shards %v, after %v", ended, took, unix.SignalName(tc.sig))
			require.Less(t, ended, ttl+slack, "the first member's commands outlived its lease")
			require.GreaterOrEqual(t, took, ttl, "before the first member's lease could expire")
			require.Less(t, took, ttl+slack+5*time.Second*slowdown)
			gones := 0
			if !tc.term {
				gones = 2
			}
			require.Equal(t, gones, l.gones, "the first member's commands killed at the deadline (not told to stop)")
			checkOwners(t, name, 4, l)

			if tc.sig == syscall.SIGSTOP {
				a.signal(t, syscall.SIGCONT)
				require.Equal(t, 137, a.wait(t), "stderr: %s", a.stderr.String())
				lines := strings.Split(strings.TrimSuffix(a.stderr.String(), "\n"), "\n")
				require.Contains(t, lines[len(lines)-1], "lockctl: lost the shards of "+name+": ")
				require.Contains(t, lines[len(lines)-1], "lost contact")
				runs := len(l.runs)
				l = readShardLog(t, log)
				require.Len(t, l.runs, runs, "a run after the first member was continued")
				require.Equal(t, map[string]int{lb: 4}, l.perLease(), "the second member runs all 4")
				checkOwners(t, name, 4, l)
			} else {
				a.wait(t)
			}

			b.signal(t, syscall.SIGTERM)
			require.Equal(t, 0, b.wait(t), "stderr: %s", b.stderr.String())
			l = readShardLog(t, log)
			require.Empty(t, l.open, "commands still running")
			for _, r := range l.runs {
				require.True(t, gone(r.pid), "command %d left running", r.pid)
			}
			noKeys(t, name)
		})
	}
}

// An admin revokes a member's lease: its commands get SIGTERM, and it
// exits 143, saying why in its last line.
func TestShardsSessionRevoked(t *testing.T) {
	t.Parallel()
	name, log := uniqueName(t), filepath.Join(t.TempDir(), "log")
	p := startShards(t, log, name, 2)
	var lease string
	waitShards(t, log, onlyLease(&lease, 2), "the member runs both")
	id, err := strconv.ParseInt(lease, 16, 64)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	_, err = admin.Revoke(ctx, clientv3.LeaseID(id))
	require.NoError(t, err)
	code := p.wait(t)
	b, _ := os.ReadFile(log)
	require.Equal(t, 143, code, "stderr: %s\nlog:\n%s", p.stderr.String(), b)
	lines := strings.Split(strings.TrimSuffix(p.stderr.String(), "\n"), "\n")
	require.Contains(t, lines[len(lines)-1], "lockctl: lost the shards of "+name)
	l := readShardLog(t, log)
	require.Empty(t, l.open, "commands still running")
	require.Equal(t, 2, l.stops)
	noKeys(t, name)
}

// Usage errors and a command that is not there end lockctl shards before
// it connects.
func TestShardsUsage(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"shards", "x", "4"}, exitUsage, "missing --"},
		{[]string{"shards", "x", "--", "true"}, exitUsage, "want NAME N before --"},
		{[]string{"shards", "x", "0", "--", "true"}, exitUsage, `N "0": want a whole number of shards`},
		{[]string{"shards", "x", "four", "--", "true"}, exitUsage, `N "four"`},
		{[]string{"shards", "--max", "-1", "x", "4", "--", "true"}, exitUsage, "--max -1"},
		{[]string{"shards", "--ttl", "500ms", "x", "4", "--", "true"}, exitUsage, "--ttl 500ms"},
		{[]string{"shards", "", "4", "--", "true"}, exitUsage, "empty"},
		{[]string{"shards", "x", "4", "--", "no-such-command-here"}, exitNotFound, "not found"},
	} {
		code, p := run(t, tc.args...)
		require.Equal(t, tc.code, code, "%q: stderr: %s", tc.args, p.stderr.String())
		require.Contains(t, oneLine(t, p.stderr.String()), tc.msg, "%q", tc.args)
	}
}

// A member that asks for another N than the running members exits 1,
// naming both counts, and the running member goes on.
func TestShardsOtherN(t *testing.T) {
	t.Parallel()
	name, log := uniqueName(t), filepath.Join(t.TempDir(), "log")
	a := startShards(t, log, name, 2)
	var lease string
	waitShards(t, log, onlyLease(&lease, 2), "the first member runs both")
	code, b := run(t, "shards", name, "3", "--", "true")
	require.Equal(t, exitFailure, code, "stderr: %s", b.stderr.String())
	line := oneLine(t, b.stderr.String())
	require.Contains(t, line, "asks for 3 shards")
	require.Contains(t, line, "n=2")
	require.True(t, a.running())
	require.Equal(t, map[string]int{lease: 2}, readShardLog(t, log).perLease())
	a.signal(t, syscall.SIGTERM)
	require.Equal(t, 0, a.wait(t), "stderr: %s", a.stderr.String())
	noKeys(t, name)
}

// A command that is there but cannot be started (no #! line) ends lockctl
// shards with 126, leaving nothing in etcd.
func TestShardsCannotStart(t *testing.T) {
	t.Parallel()
	name, dir := uniqueName(t), t.TempDir()
	script := filepath.Join(dir, "script")
	require.NoError(t, os.WriteFile(script, []byte("echo no shebang\n"), 0o755))
	code, p := run(t, "shards", name, "2", "--", script)
	require.Equal(t, exitNoExec, code, "stderr: %s", p.stderr.String())
	lines := strings.Split(strings.TrimSuffix(p.stderr.String(), "\n"), "\n")
	require.Contains(t, lines[len(lines)-1], "exec format error")
	noKeys(t, name)
}

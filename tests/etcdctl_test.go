package tests

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
)

// etcdctl returns the path of the etcdctl binary this module pins as a tool
// (go.mod's tool directive), building it if needed.
func etcdctl(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("building etcdctl skipped in -short")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, "go", "tool", "-n", "etcdctl").Output()
	require.NoError(t, err, "go tool -n etcdctl")
	return strings.TrimSpace(string(out))
}

// Invariant "Interop": `etcdctl lock` and our Mutex exclude each other.
func TestEtcdctlLockInterop(t *testing.T) {
	t.Parallel()
	bin := etcdctl(t)
	c, cli, ctx := singleClient(t)
	ours := heldMutex(t, ctx, cli, "ctl-lock")

	cmd := exec.CommandContext(ctx, bin, "--endpoints="+c.Endpoints()[0], "lock", "ctl-lock", "echo", "etcdctl-held-it")
	out := &strings.Builder{}
	cmd.Stdout = out
	require.NoError(t, cmd.Start())
	exited := async(func() error { return cmd.Wait() })
	waitKeys(t, cli, "ctl-lock/", 2)
	select {
	case err := <-exited:
		t.Fatalf("etcdctl lock returned while we hold the lock: %v, %q", err, out.String())
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, ours.Unlock(ctx))
	require.NoError(t, resultWithin(t, exited, testTimeout, "etcdctl lock after our Unlock"))
	require.Contains(t, out.String(), "etcdctl-held-it")
	require.Empty(t, keys(t, cli, "ctl-lock/"))

	// And the other way round: etcdctl holds while it runs a command that
	// waits for a file; our TryLock fails, then our Lock waits.
	release := filepath.Join(t.TempDir(), "release")
	hold := exec.CommandContext(ctx, bin, "--endpoints="+c.Endpoints()[0], "lock", "ctl-lock", "--",
		"sh", "-c", "while [ ! -e "+release+" ]; do sleep 0.05; done")
	require.NoError(t, hold.Start())
	waitKeys(t, cli, "ctl-lock/", 1)
	require.ErrorIs(t, ours.TryLock(ctx), etcdsync.ErrLocked)
	got := lockAsync(t, ctx, ours)
	notWithin(t, got, 300*time.Millisecond, "our Lock while etcdctl holds")
	require.NoError(t, os.WriteFile(release, nil, 0o644)) // the command ends, etcdctl releases
	within(t, got, testTimeout, "our Lock after etcdctl released")
	require.NoError(t, hold.Wait())
	require.NoError(t, ours.Unlock(ctx))
}

// Issue 3: `etcdctl elect` sees our leader and we see its leader.
func TestEtcdctlElectInterop(t *testing.T) {
	t.Parallel()
	bin := etcdctl(t)
	c, cli, ctx := singleClient(t)
	ours := etcdsync.NewElection(session(t, cli), "ctl-elect")
	require.NoError(t, ours.Campaign(ctx, "ours"))

	// `etcdctl elect -l` observes: its first lines name our leader.
	listen := exec.CommandContext(ctx, bin, "--endpoints="+c.Endpoints()[0], "elect", "-l", "ctl-elect")
	lout, err := listen.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, listen.Start())
	t.Cleanup(func() { listen.Process.Kill(); listen.Wait() })
	lines := bufio.NewScanner(lout)
	require.True(t, lines.Scan())
	require.Equal(t, ours.Key(), lines.Text())
	require.True(t, lines.Scan())
	require.Equal(t, "ours", lines.Text())

	// `etcdctl elect` campaigns behind us and leads after our Resign.
	camp := exec.CommandContext(ctx, bin, "--endpoints="+c.Endpoints()[0], "elect", "ctl-elect", "theirs")
	cout, err := camp.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, camp.Start())
	t.Cleanup(func() { camp.Process.Kill(); camp.Wait() })
	waitKeys(t, cli, "ctl-elect/", 2)
	require.Equal(t, "ours", leaderValue(t, ours))
	require.NoError(t, ours.Resign(ctx))
	elected := make(chan struct{})
	go func() {
		r := bufio.NewScanner(cout)
		for r.Scan() && !strings.HasPrefix(r.Text(), "ctl-elect/") { // it prints its key once elected
		}
		close(elected)
		io.Copy(io.Discard, cout)
	}()
	within(t, elected, testTimeout, "etcdctl elected after our Resign")
	require.Equal(t, "theirs", leaderValue(t, ours))

	// An interrupted `etcdctl elect` resigns; our Campaign then leads.
	got := campaignAsync(ctx, ours, "ours-again")
	require.NoError(t, camp.Process.Signal(syscall.SIGINT))
	select {
	case err := <-got:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Logf("keys: %v, ours %q", keys(t, cli, "ctl-elect/"), ours.Key())
		t.Fatal("our Campaign did not lead after etcdctl resigned")
	}
	require.Equal(t, "ours-again", leaderValue(t, ours))
	require.NoError(t, ours.Resign(ctx))
}

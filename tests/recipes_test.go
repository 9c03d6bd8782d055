package tests

// Recipes and interop: the places where a user's code meets the library,
// and etcdctl's lock and elect beside it.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Run a cron job once per period across processes. Every process runs the
// same code on schedule; the lock keeps two from running at once, and a
// per-period key, written in the same guarded transaction that checks it,
// keeps a second process from running the period again after the first
// finished. One transaction tells the three outcomes apart: the hold is lost
// (Do returns ErrNotHeld), the period was already claimed (the inner
// transaction did not succeed), or this process claims it.
//
// The check must be one an absent key passes: CreateRevision (or Version)
// equal to 0. A comparison of an absent key's Value is always false, so
// "Value == \"\"" never lets anyone run the job.
func Example_cronOncePerPeriod() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	period := "2026-11-23" // from the schedule: time.Now().Format(time.DateOnly), say
	runOnce := func(host string) {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		m := etcdsync.NewMutex(s, "/cron/nightly-report")
		err = m.Run(ctx, func(ctx context.Context) error {
			done := "/cron/nightly-report-done/" + period
			resp, err := m.Do(ctx, clientv3.OpTxn(
				[]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(done), "=", 0)},
				[]clientv3.Op{clientv3.OpPut(done, host)},
				[]clientv3.Op{clientv3.OpGet(done)}))
			switch {
			case errors.Is(err, etcdsync.ErrNotHeld):
				return err // lost the lock: another process may be running the job
			case err != nil:
				return err
			case !resp.Responses[0].GetResponseTxn().Succeeded:
				ran := resp.Responses[0].GetResponseTxn().Responses[0].GetResponseRange().Kvs[0].Value
				fmt.Printf("%s: %s already ran by %s\n", host, period, ran)
				return nil
			}
			fmt.Printf("%s: runs the job for %s\n", host, period)
			return nil // the job, under m.Do for writes to etcd, or fenced by m.Rev() elsewhere
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	runOnce("host-a")
	runOnce("host-b")
	// Output:
	// host-a: runs the job for 2026-11-23
	// host-b: 2026-11-23 already ran by host-a
}

// When a Session ends (its lease expired, was revoked, or contact was lost
// past the TTL), every hold on it has ended and it can never hold again:
// make a new Session and new values from it, in a loop. Here an admin
// revokes the first session's lease while its job runs; Run returns an
// error wrapping ErrSessionExpired (the job's context carries the cause)
// and the loop goes on with a new session.
func Example_newSessionAfterEnd() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	for attempt := 1; attempt <= 2; attempt++ {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(5*time.Second))
		if err != nil {
			time.Sleep(time.Second) // etcd unreachable: try again later
			continue
		}
		err = etcdsync.NewMutex(s, "/jobs/single-writer").Run(ctx, func(ctx context.Context) error {
			if attempt == 1 {
				cli.Revoke(ctx, s.Lease()) // the fault, for the example
				<-ctx.Done()               // the job stops when the hold ends
				return context.Cause(ctx)
			}
			fmt.Println("attempt", attempt, "did the work")
			return nil
		})
		s.Close()
		switch {
		case errors.Is(err, etcdsync.ErrSessionExpired) || errors.Is(err, etcdsync.ErrNotHeld):
			fmt.Println("attempt", attempt, "lost its hold; a new session")
			continue
		case err != nil:
			log.Fatal(err)
		}
		break
	}
	// Output:
	// attempt 1 lost its hold; a new session
	// attempt 2 did the work
}

// Follow a leader from a process that does not campaign, with no lease:
// an Observer reads the leader and its value, and Observe sends every
// change in order.
func ExampleObserver() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	obs := etcdsync.NewObserver(cli, "/services/billing-leader")
	if _, err := obs.Leader(ctx); errors.Is(err, etcdsync.ErrElectionNoLeader) {
		fmt.Println("no leader yet")
	}
	changes := obs.Observe(ctx)

	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	e := etcdsync.NewElection(s, "/services/billing-leader")
	if err := e.Campaign(ctx, "host-a:8080"); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("leader: %s\n", (<-changes).Kvs[0].Value)
	if err := e.Proclaim(ctx, "host-a:9090"); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("leader: %s\n", (<-changes).Kvs[0].Value)
	// Output:
	// no leader yet
	// leader: host-a:8080
	// leader: host-a:9090
}

// A name is a key prefix, as in etcd: "/x" and "/x/" are two different
// names (keys "/x/<lease>" and "/x//<lease>") and do not exclude each other;
// neither does "/x/y" exclude "/x" (a lock's queue is only its direct
// children). Pick one spelling for each lock.
func Example_names() {
	cli, stop := exampleEtcd()
	defer stop()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var ss []*etcdsync.Session
	for range 3 {
		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(10*time.Second))
		if err != nil {
			log.Fatal(err)
		}
		defer s.Close()
		ss = append(ss, s)
	}
	for i, name := range []string{"/x", "/x/", "/x/y"} {
		fmt.Printf("%q: %v\n", name, etcdsync.NewMutex(ss[i], name).TryLock(ctx))
	}
	fmt.Println(`"/x" again:`, errors.Is(etcdsync.NewMutex(ss[1], "/x").TryLock(ctx), etcdsync.ErrLocked))
	// Output:
	// "/x": <nil>
	// "/x/": <nil>
	// "/x/y": <nil>
	// "/x" again: true
}

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

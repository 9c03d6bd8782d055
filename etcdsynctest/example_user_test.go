package etcdsynctest_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
)

// This file is the test the package documentation shows: a user's service
// that works only while it holds a lock, and a test that takes the lock
// away by cutting the service's link to etcd.

// errLockLost is what reporter.Run returns when its hold ends under it.
var errLockLost = errors.New("reporter: lock lost")

// reporter is the user's service: it writes a report every 50ms, and only
// while it holds its Mutex.
type reporter struct {
	mutex   *etcdsync.Mutex
	busy    atomic.Bool  // between taking the lock and stopping
	reports atomic.Int64 // reports written
}

// Run takes the lock and reports until the hold ends (errLockLost) or ctx
// ends (the lock released, ctx's error).
func (r *reporter) Run(ctx context.Context) error {
	if err := r.mutex.Lock(ctx); err != nil {
		return err
	}
	r.busy.Store(true)
	defer r.busy.Store(false)
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-r.mutex.Done():
			return errLockLost
		case <-ctx.Done():
			release, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return errors.Join(ctx.Err(), r.mutex.Unlock(release))
		case <-tick.C:
			r.reports.Add(1)
		}
	}
}

// working reports whether the reporter holds its lock and has written a report.
func (r *reporter) working() bool { return r.busy.Load() && r.reports.Load() > 0 }

// waitFor fails t unless cond becomes true within 10s.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); !cond(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatal("not within 10s")
		}
	}
}

func TestReporterStopsWhenItLosesTheLock(t *testing.T) {
	t.Parallel() // each test has a cluster of its own
	c := etcdsynctest.StartCluster(t, 1)
	cli, link := c.ClientThrough(t)
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	r := &reporter{mutex: etcdsync.NewMutex(s, "jobs/report")}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- r.Run(ctx) }()
	waitFor(t, r.working) // it holds the lock and writes reports

	link.Cut() // etcd no longer hears from it: its lease runs out
	select {
	case err := <-stopped:
		if !errors.Is(err, errLockLost) {
			t.Fatalf("Run returned %v, want errLockLost", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("still running 10s after its link was cut")
	}
	if r.working() {
		t.Fatal("it says it still works after it stopped")
	}

	// Not part of the documented test: the hold really ended, and the
	// lock is free for a process that etcd can hear.
	select {
	case <-r.mutex.Done():
	default:
		t.Fatal("Run stopped but the hold's Done is open")
	}
	other, err := etcdsync.NewSession(c.Client(t), etcdsync.WithTTL(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { other.Close() })
	m := etcdsync.NewMutex(other, "jobs/report")
	waitFor(t, func() bool { return m.TryLock(ctx) == nil })
}

// The test in the package documentation is this file's test, line for line,
// up to its closing brace.
func TestDocShowsThisTest(t *testing.T) {
	src, err := os.ReadFile("etcdsynctest.go")
	if err != nil {
		t.Fatal(err)
	}
	var shown []string
	for _, l := range strings.Split(string(src), "\n") {
		switch {
		case strings.HasPrefix(l, "//\tfunc TestReporterStopsWhenItLosesTheLock"), len(shown) > 0 && strings.HasPrefix(l, "//\t"):
			shown = append(shown, strings.TrimPrefix(l, "//\t"))
		case len(shown) > 0 && l == "//" && shown[len(shown)-1] != "}":
			shown = append(shown, "")
		}
		if len(shown) > 0 && shown[len(shown)-1] == "}" {
			break
		}
	}
	if len(shown) < 10 {
		t.Fatalf("the package documentation shows no test (%d lines)", len(shown))
	}
	test, err := os.ReadFile("example_user_test.go")
	if err != nil {
		t.Fatal(err)
	}
	body := string(test)[strings.Index(string(test), "\nfunc TestReporterStopsWhenItLosesTheLock")+1:]
	want := strings.Join(shown[:len(shown)-1], "\n") + "\n"
	if !strings.HasPrefix(body, want) {
		t.Fatalf("the documentation's test differs from example_user_test.go's:\n%s", want)
	}
}

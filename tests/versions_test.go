package tests

// Server lines (issue 37): which path a handoff takes on each etcd server
// line, and what a handoff costs beside the floor. The embedded member is etcd 3.7; the others are the
// binaries of the compatibility matrix (etcdBinaries), skipped when unset.

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// serverLine is an etcd server to measure: start returns its client URL.
type serverLine struct {
	name  string
	start func(tb testing.TB) string
}

// serverLines are the embedded member (fsync as fsync says) and each etcd
// binary (fsync on unless fsync is false).
func serverLines(fsync bool) []serverLine {
	lines := []serverLine{{"embedded", func(tb testing.TB) string {
		return etcdtest.Start(tb, etcdtest.Options{Fsync: fsync}).Endpoints()[0]
	}}}
	for _, b := range etcdBinaries {
		lines = append(lines, serverLine{b.rig, func(tb testing.TB) string {
			var extra []string
			if !fsync {
				extra = []string{"--unsafe-no-fsync"}
			}
			return runEtcdBinary(tb, b.path(tb), extra...)
		}})
	}
	return lines
}

// perServerLine runs f as a parallel subtest per server line (see
// serverLines), with the line's endpoint, a client of it and the version it
// reports; in -short it skips t.
func perServerLine(t *testing.T, f func(t *testing.T, ep string, admin *clientv3.Client, v string)) {
	t.Parallel()
	if testing.Short() {
		t.Skip("skipped in -short")
	}
	for _, line := range serverLines(false) {
		t.Run(line.name, func(t *testing.T) {
			t.Parallel()
			ep := line.start(t)
			admin := etcdtest.NewClient(t, []string{ep})
			f(t, ep, admin, serverVersion(t, admin, ep))
		})
	}
}

// serverVersion returns the version the server at ep reports.
func serverVersion(tb testing.TB, cli *clientv3.Client, ep string) string {
	ctx, cancel := context.WithTimeout(context.Background(), cellTimeout)
	defer cancel()
	resp, err := cli.Status(ctx, ep)
	require.NoError(tb, err)
	return resp.Version
}

// On each server line (Debian's 3.4.23, 3.5.35, 3.6, 3.7) a handoff takes
// no RPC after the predecessor's delete: the waiter, which watches the
// whole prefix, takes its turn on the delete's event alone, with no
// progress request (whose answers 3.4 and 3.5 may send ahead of the events
// they vouch for) and no read. Counted on the waiter's client from the
// holder's Unlock to the waiter's Lock, the first wait on the client
// included.
func TestHandoffPathPerServer(t *testing.T) {
	perServerLine(t, func(t *testing.T, ep string, admin *clientv3.Client, v string) {
		const want = 0
		ctx := ctxCell(t)
		cnt := &counter{created: make(chan struct{}, 16)}
		cli := etcdtest.NewClient(t, []string{ep}, cnt.dial()...)
		holder := etcdsync.NewMutex(session(t, admin), "path")
		waiter := etcdsync.NewMutex(session(t, cli), "path")
		var got []int64
		for range 4 {
			require.NoError(t, holder.Lock(ctx))
			w := async(func() error { return waiter.Lock(ctx) })
			within(t, cnt.created, cellTimeout, "the waiter's watch of the prefix")
			before := cnt.unary.Load()
			require.NoError(t, holder.Unlock(ctx))
			require.NoError(t, resultWithin(t, w, cellTimeout, "handoff"))
			got = append(got, cnt.unary.Load()-before)
			require.NoError(t, waiter.Unlock(ctx))
		}
		t.Logf("etcd %s: RPCs after the predecessor's delete, per handoff: %v", v, got)
		for i, n := range got {
			require.EqualValues(t, want, n, "etcd %s: RPCs on the critical path of handoff %d", v, i)
		}
		require.Empty(t, keys(t, admin, "path/"))
	})
}

// A handoff on each server line beside its floor: the holder's Unlock to
// the waiter's Lock (one waiter), with the RPCs the waiter's client sends
// in between (rpcs/handoff: 0 where a progress request confirms the turn, 1
// where a read does); and the floor, one delete committed plus its event on
// a raw watch stream, on the same server. The embedded member is etcd 3.7;
// the binaries are those of etcdBinaries (skipped when unset). With
// -fsync=false the binaries run with --unsafe-no-fsync.
func BenchmarkHandoffPerServer(b *testing.B) {
	for _, line := range serverLines(*benchFsync) {
		b.Run(line.name, func(b *testing.B) {
			ep := line.start(b)
			admin := etcdtest.NewClient(b, []string{ep})
			b.Logf("etcd %s", serverVersion(b, admin, ep))
			b.Run("floor", func(b *testing.B) { benchFloorAt(b, ep, admin) })
			b.Run("handoff", func(b *testing.B) { benchHandoffRPCs(b, ep, admin) })
		})
	}
}

// benchHandoffRPCs measures one waiter's handoffs on the server at ep: the
// holder on admin, the waiter on a counted client. The first handoff (the
// version check, the probe) is not sampled.
func benchHandoffRPCs(b *testing.B, ep string, admin *clientv3.Client) {
	ctx := context.Background()
	cnt := &counter{created: make(chan struct{}, 16)}
	cli := etcdtest.NewClient(b, []string{ep}, cnt.dial()...)
	holder := etcdsync.NewMutex(session(b, admin), "bench-path")
	waiter := etcdsync.NewMutex(session(b, cli), "bench-path")
	var samples []time.Duration
	var rpcs int64
	handoff := func(sample bool) {
		b.StopTimer()
		must(b, holder.Lock(ctx))
		w := make(chan error, 1)
		go func() { w <- waiter.Lock(ctx) }()
		select { // the waiter's watch of the prefix
		case <-cnt.created:
		case <-time.After(cellTimeout):
			b.Fatal("the waiter's watch was not created")
		}
		before := cnt.unary.Load()
		b.StartTimer()
		start := time.Now()
		must(b, holder.Unlock(ctx))
		must(b, <-w)
		d := time.Since(start)
		b.StopTimer()
		if sample {
			samples = append(samples, d)
			rpcs += cnt.unary.Load() - before
		}
		must(b, waiter.Unlock(ctx))
	}
	handoff(false)
	b.ResetTimer()
	for range b.N {
		handoff(true)
	}
	reportLatency(b, samples, "handoff-")
	b.ReportMetric(float64(rpcs)/float64(b.N), "rpcs/handoff")
}

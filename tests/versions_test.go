package tests

// Server lines (issue 37): which path a handoff takes on each etcd server
// line, whether the servers answer progress requests in order with events
// (the property the zero-RPC handoff relies on), and what a handoff costs
// beside the floor. The embedded member is etcd 3.7; the others are the
// binaries of the compatibility matrix (etcdBinaries), skipped when unset.

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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

// fixedFor15220 reports whether a server of version v answers progress
// requests in order with events: from 3.5.8 and 3.6.0 on (3.4.25's fix is
// known from a changelog alone, so 3.4 is not counted).
func fixedFor15220(v string) bool {
	var major, minor, patch int
	if _, err := fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &patch); err != nil {
		return false
	}
	switch {
	case major != 3:
		return major > 3
	case minor == 5:
		return patch >= 8
	}
	return minor >= 6
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

// Whether a server answers progress requests in order with events: one
// client watches a prefix while writers put batches under it and another
// goroutine asks for progress every millisecond on the same stream. An
// answer at revision R vouches for every event up to R: an event of
// revision R or lower after it is out of order. Servers with the fix of
// etcd#15220 must show none; the others are measured and logged (the race
// is lost now and then, which is why no probe can tell the two apart).
func TestProgressAnswersInOrder(t *testing.T) {
	perServerLine(t, func(t *testing.T, ep string, admin *clientv3.Client, v string) {
		answers, late, events := progressOrder(t, ep, admin, 3*time.Second)
		t.Logf("etcd %s: %d progress answers, %d events, %d events after an answer that vouched for them", v, answers, events, late)
		require.Positive(t, answers, "etcd %s answered no progress request", v)
		if fixedFor15220(v) {
			require.Zero(t, late, "etcd %s: events after a progress answer of their revision", v)
		}
	})
}

// progressOrder runs TestProgressAnswersInOrder's load on the server at ep
// for d and returns the progress answers seen, the events seen after an
// answer whose revision is theirs or later, and the events seen.
func progressOrder(t *testing.T, ep string, admin *clientv3.Client, d time.Duration) (answers, late, events int) {
	ctx, cancel := context.WithTimeout(context.Background(), d+cellTimeout)
	defer cancel()
	watcher := etcdtest.NewClient(t, []string{ep})
	start, err := admin.Get(ctx, "order/", clientv3.WithCountOnly())
	require.NoError(t, err)
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	wch := watcher.Watch(wctx, "order/", clientv3.WithPrefix(), clientv3.WithRev(start.Header.Revision+1), clientv3.WithCreatedNotify())
	created := <-wch
	require.True(t, created.Created, "the watch's first response: %+v", created)

	loadCtx, stopLoad := context.WithTimeout(ctx, d)
	defer stopLoad()
	var wg sync.WaitGroup
	var lastRev atomic.Int64
	for w := range 3 { // writers: batches of puts, one revision each
		wg.Go(func() {
			ops := make([]clientv3.Op, 16)
			for n := 0; loadCtx.Err() == nil; n++ {
				for i := range ops {
					ops[i] = clientv3.OpPut("order/"+strconv.Itoa(w)+"/"+strconv.Itoa(i), strconv.Itoa(n))
				}
				resp, err := admin.Txn(loadCtx).Then(ops...).Commit()
				if err != nil {
					return
				}
				for cur := lastRev.Load(); resp.Header.Revision > cur && !lastRev.CompareAndSwap(cur, resp.Header.Revision); cur = lastRev.Load() {
				}
			}
		})
	}
	wg.Go(func() {
		for loadCtx.Err() == nil {
			if watcher.RequestProgress(wctx) != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
	})
	var vouched int64 // the highest revision a progress answer vouched for
	var seen int64    // the highest event revision seen
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for loadCtx.Err() == nil || seen < lastRev.Load() { // until every write's events came
		select {
		case wr, ok := <-wch:
			require.True(t, ok, "the watch ended before it caught up with the writes")
			require.NoError(t, wr.Err())
			if wr.IsProgressNotify() {
				answers++
				vouched = max(vouched, wr.Header.Revision)
			}
			for _, ev := range wr.Events {
				events++
				seen = max(seen, ev.Kv.ModRevision)
				if ev.Kv.ModRevision <= vouched {
					late++
				}
			}
		case <-tick.C:
		case <-ctx.Done():
			t.Fatalf("the watch did not catch up with the writes within %v (at %d of %d)", cellTimeout, seen, lastRev.Load())
		}
	}
	stopLoad()
	wg.Wait()
	_, err = admin.Delete(ctx, "order/", clientv3.WithPrefix())
	require.NoError(t, err)
	return answers, late, events
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
	holder := etcdsync.NewMutex(benchSession(b, admin), "bench-path")
	waiter := etcdsync.NewMutex(benchSession(b, cli), "bench-path")
	var samples []time.Duration
	var rpcs int64
	handoff := func(sample bool) {
		b.StopTimer()
		must(b, holder.Lock(ctx))
		w := make(chan error, 1)
		go func() { w <- waiter.Lock(ctx) }()
		for range 2 { // the waiter's watches of its key and the holder's
			select {
			case <-cnt.created:
			case <-time.After(cellTimeout):
				b.Fatal("the waiter's watches were not created")
			}
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

// The library's stream shape, in order: one gRPC stream carrying watches of
// single keys with WithFilterPut (a waiter's own key and the keys ahead), a
// prefix watch with WithPrevKV and WithFragment whose responses exceed the
// server's request limit (fragments), and watches added from the current
// revision as the load runs, while a writer puts a batch of large values
// twice and deletes it by prefix (one revision, many deletes) over and
// over, and progress is asked every millisecond on the stream. An answer
// at revision R reaches every watch of the stream and vouches for each
// one's events up to R: an event of revision R or lower on a watch after
// an answer it got is out of order. Held on 3.5.35 and 3.7.3.
func TestProgressAnswersInOrderOnTheLibrarysStream(t *testing.T) {
	perServerLine(t, func(t *testing.T, ep string, admin *clientv3.Client, v string) {
		r := progressOrderShaped(t, ep, admin, 3*time.Second, false)
		t.Logf("etcd %s: %d progress answers (summed over watches), %d events, %d fragmented responses, %d events after an answer that vouched for them", v, r.answers, r.events, r.fragmented, r.late)
		require.Positive(t, r.answers, "etcd %s answered no progress request", v)
		require.Positive(t, r.fragmented, "etcd %s: no fragmented response", v)
		if fixedFor15220(v) {
			require.Zero(t, r.late, "etcd %s: events after a progress answer of their revision", v)
		}
	})
}

type shapedResult struct {
	answers, late, events, fragmented int
	lateSeen                          []string
}

// progressOrderShaped runs the load of TestProgressAnswersInOrderOnTheLibrarysStream
// on the server at ep for d, the watches added as it runs from a past
// revision if past, and says what the watches saw.
func progressOrderShaped(t *testing.T, ep string, admin *clientv3.Client, d time.Duration, past bool) (r shapedResult) {
	ctx, cancel := context.WithTimeout(context.Background(), d+cellTimeout)
	defer cancel()
	watcher := etcdtest.NewClient(t, []string{ep})
	const keysN = 8
	big := strings.Repeat("v", 180<<10) // 8 puts with their prev values: past the 1.5 MiB limit
	start, err := admin.Get(ctx, "shaped/", clientv3.WithCountOnly())
	require.NoError(t, err)
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()

	var mu sync.Mutex
	var readers sync.WaitGroup
	var lastRev atomic.Int64
	loadCtx, stopLoad := context.WithTimeout(ctx, d)
	defer stopLoad()
	answers, late, events, fragmented := &r.answers, &r.late, &r.events, &r.fragmented
	read := func(tag string, wch clientv3.WatchChan, until func(seen int64) bool) {
		readers.Go(func() {
			var vouched, seen, created int64
			for {
				select {
				case wr, ok := <-wch:
					if !ok {
						return
					}
					mu.Lock()
					if wr.Created {
						created = wr.Header.Revision
					}
					if wr.IsProgressNotify() {
						*answers++
						vouched = max(vouched, wr.Header.Revision)
					}
					size := 0
					for _, ev := range wr.Events {
						size += len(ev.Kv.Value)
						if ev.PrevKv != nil {
							size += len(ev.PrevKv.Value)
						}
					}
					if size > 3<<19 { // past the server's 1.5 MiB: it came in fragments
						*fragmented++
					}
					for _, ev := range wr.Events {
						*events++
						seen = max(seen, ev.Kv.ModRevision)
						if ev.Kv.ModRevision <= vouched {
							*late++
							if len(r.lateSeen) < 10 {
								r.lateSeen = append(r.lateSeen, fmt.Sprintf("%s: %s %s@%d after an answer at %d (response header %d, %d events)", tag, ev.Type, ev.Kv.Key, ev.Kv.ModRevision, vouched, wr.Header.Revision, len(wr.Events)))
							}
						}
					}
					mu.Unlock()
				case <-time.After(10 * time.Millisecond):
				}
				if loadCtx.Err() != nil && until(max(seen, created)) || ctx.Err() != nil {
					return
				}
			}
		})
	}
	caughtUp := func(seen int64) bool { return seen >= lastRev.Load() }
	// The prefix watch (fragments) and the keys' watches (deletes only).
	pre := watcher.Watch(wctx, "shaped/", clientv3.WithPrefix(), clientv3.WithRev(start.Header.Revision+1), clientv3.WithPrevKV(), clientv3.WithFragment(), clientv3.WithCreatedNotify())
	require.True(t, (<-pre).Created)
	read("prefix", pre, caughtUp)
	for i := range keysN {
		wch := watcher.Watch(wctx, "shaped/"+strconv.Itoa(i), clientv3.WithFilterPut(), clientv3.WithCreatedNotify())
		require.True(t, (<-wch).Created)
		read("key "+strconv.Itoa(i), wch, caughtUp)
	}

	var wg sync.WaitGroup
	wg.Go(func() { // writer: a batch of large puts, then its delete by prefix
		puts := make([]clientv3.Op, keysN)
		for loadCtx.Err() == nil {
			for i := range puts {
				puts[i] = clientv3.OpPut("shaped/"+strconv.Itoa(i), big)
			}
			for range 2 { // the second with the first's values as prev: fragments
				if _, err := admin.Txn(loadCtx).Then(puts...).Commit(); err != nil {
					return
				}
			}
			resp, err := admin.Delete(loadCtx, "shaped/", clientv3.WithPrefix())
			if err != nil {
				return
			}
			lastRev.Store(resp.Header.Revision)
		}
	})
	wg.Go(func() { // more watches on the stream as the load runs, some from the past
		for n := 0; loadCtx.Err() == nil && n < 40; n++ {
			opts := []clientv3.OpOption{clientv3.WithFilterPut(), clientv3.WithCreatedNotify()}
			if past && n%2 == 0 {
				opts = append(opts, clientv3.WithRev(max(start.Header.Revision+1, lastRev.Load()-5)))
			}
			read(fmt.Sprintf("added %d (past: %v)", n, past && n%2 == 0), watcher.Watch(wctx, "shaped/"+strconv.Itoa(n%keysN), opts...), caughtUp)
			time.Sleep(50 * time.Millisecond)
		}
	})
	wg.Go(func() {
		for loadCtx.Err() == nil {
			if watcher.RequestProgress(wctx) != nil {
				return
			}
			time.Sleep(time.Millisecond)
		}
	})
	wg.Wait()
	readers.Wait()
	require.NoError(t, ctx.Err(), "the watches did not catch up with the writes")
	stopWatch()
	return r
}

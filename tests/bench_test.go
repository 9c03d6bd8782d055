package tests

// Benchmarks, ours and etcd's concurrency package side by side on one
// embedded member with fsync on. Counts (rpcs/op, writes/op, events/op) do
// not depend on machine noise; latencies are reported as p50/p90 in ms, and
// the floor (one delete committed plus its watch event delivered to another
// client) is measured in the same run. BENCHMARKS.md has the figures.

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	recipe "go.etcd.io/etcd/client/v3/experimental/recipes"
	"google.golang.org/grpc"
)

// benchFsync keeps fsync on in the benchmarks' etcd (a production disk);
// -fsync=false shows the client's own costs.
var benchFsync = flag.Bool("fsync", true, "benchmarks: fsync on the embedded etcd member")

// benchHold is how long each new holder of BenchmarkHandoff's chain holds
// before it unlocks (its work); 0, the default, unlocks at once.
var benchHold = flag.Duration("hold", 0, "benchmarks: BenchmarkHandoff's hold time per holder")

type benchMutex interface {
	Lock(context.Context) error
	TryLock(context.Context) error
	Unlock(context.Context) error
}

type benchElection interface {
	Campaign(context.Context, string) error
	Proclaim(context.Context, string) error
	Resign(context.Context) error
}

type lib struct {
	name        string
	watches     func(ahead int) int // watches a waiter creates with ahead keys listed before its own
	newMutex    func(b *testing.B, cli *clientv3.Client, name string) benchMutex
	newElection func(b *testing.B, cli *clientv3.Client, name string) benchElection
}

var libs = []lib{
	{
		name:    "etcdsync",
		watches: func(ahead int) int { return waits(ahead, 1) }, // the prefix, or own key and the third key ahead
		newMutex: func(b *testing.B, cli *clientv3.Client, name string) benchMutex {
			return etcdsync.NewMutex(session(b, cli), name)
		},
		newElection: func(b *testing.B, cli *clientv3.Client, name string) benchElection {
			return etcdsync.NewElection(session(b, cli), name)
		},
	},
	{
		name:    "concurrency",
		watches: func(int) int { return 1 },
		newMutex: func(b *testing.B, cli *clientv3.Client, name string) benchMutex {
			return concurrency.NewMutex(theirSession(b, cli), name)
		},
		newElection: func(b *testing.B, cli *clientv3.Client, name string) benchElection {
			return concurrency.NewElection(theirSession(b, cli), name)
		},
	},
}

// benchEtcd starts one member with fsync on and returns a counted client
// and an uncounted admin client.
func benchEtcd(b *testing.B) (*clientv3.Client, *counter, *clientv3.Client) {
	c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
	var cnt counter
	return c.Client(b, cnt.dial()...), &cnt, c.Client(b)
}

func must(b *testing.B, err error) {
	if err != nil {
		b.Helper()
		b.Fatal(err)
	}
}

// reportLatency reports p50 and p90 of samples in milliseconds.
func reportLatency(b *testing.B, samples []time.Duration, prefix string) {
	if len(samples) == 0 {
		return
	}
	slices.Sort(samples)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(samples[len(samples)/2]), prefix+"p50-ms")
	b.ReportMetric(ms(samples[len(samples)*9/10]), prefix+"p90-ms")
}

// Keepalive traffic of one idle session with a 1 s TTL over 3 TTLs: streams
// opened and keepalive requests sent, per TTL.
func BenchmarkKeepAliveTraffic(b *testing.B) {
	const ttl = time.Second
	for _, name := range []string{"etcdsync", "concurrency"} {
		b.Run(name, func(b *testing.B) {
			c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
			var streams, sent int64
			for i := 0; i < b.N; i++ {
				var cnt counter
				cli := c.Client(b, cnt.dial()...)
				var end func() error
				if name == "etcdsync" {
					s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
					must(b, err)
					end = s.Close
				} else {
					s, err := concurrency.NewSession(cli, concurrency.WithTTL(int(ttl/time.Second)))
					must(b, err)
					end = s.Close
				}
				s0, k0 := cnt.streams.Load(), cnt.keepalives.Load()
				time.Sleep(3 * ttl) // the interval measured
				streams += cnt.streams.Load() - s0
				sent += cnt.keepalives.Load() - k0
				must(b, end())
			}
			b.ReportMetric(float64(streams)/float64(3*b.N), "streams/ttl")
			b.ReportMetric(float64(sent)/float64(3*b.N), "keepalives/ttl")
		})
	}
}

// Uncontended Lock, then Unlock: RPCs and writes of each, and the latency
// of each (p50, p90; read off the clock around each call, no timer call).
func BenchmarkLockUnlock(b *testing.B) {
	for _, l := range libs {
		b.Run(l.name, func(b *testing.B) {
			cli, cnt, admin := benchEtcd(b)
			ctx := context.Background()
			m := l.newMutex(b, cli, "bench-lock")
			var lockRPC, unlockRPC int64
			locks, unlocks := make([]time.Duration, 0, b.N), make([]time.Duration, 0, b.N)
			start := storeRev(b, admin)
			cnt.take()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				must(b, m.Lock(ctx))
				t1 := time.Now()
				n, _ := cnt.take()
				lockRPC += n
				t2 := time.Now()
				must(b, m.Unlock(ctx))
				t3 := time.Now()
				n, _ = cnt.take()
				unlockRPC += n
				locks, unlocks = append(locks, t1.Sub(t0)), append(unlocks, t3.Sub(t2))
			}
			b.StopTimer()
			reportLatency(b, locks, "lock-")
			reportLatency(b, unlocks, "unlock-")
			b.ReportMetric(float64(lockRPC)/float64(b.N), "lock-rpcs/op")
			b.ReportMetric(float64(unlockRPC)/float64(b.N), "unlock-rpcs/op")
			b.ReportMetric(float64(storeRev(b, admin)-start)/float64(b.N), "writes/op")
		})
	}
}

// Where an uncontended Lock's and Unlock's time goes: both libraries on one
// member and one client, rounds interleaved so that the member's drift
// touches both alike, beside the bare requests of a release on a leased key
// (a compare-and-delete, which is etcdsync's fenced Unlock, and a plain
// delete, which is etcd's). p50 of each, in µs.
func BenchmarkLockUnlockParts(b *testing.B) {
	_, _, cli := benchEtcd(b)
	ctx := context.Background()
	s := session(b, cli)
	ms := make([]benchMutex, len(libs))
	for i, l := range libs {
		ms[i] = l.newMutex(b, cli, "parts-"+l.name)
	}
	locks, unlocks := make([][]time.Duration, len(libs)), make([][]time.Duration, len(libs))
	var cad, del []time.Duration
	timed := func(d *[]time.Duration, f func() error) {
		start := time.Now()
		err := f()
		*d = append(*d, time.Since(start))
		must(b, err)
	}
	leased := func(key string) int64 {
		resp, err := cli.Put(ctx, key, "", clientv3.WithLease(s.Lease()))
		must(b, err)
		return resp.Header.Revision
	}
	b.ResetTimer()
	for range b.N {
		for i, m := range ms {
			timed(&locks[i], func() error { return m.Lock(ctx) })
			timed(&unlocks[i], func() error { return m.Unlock(ctx) })
		}
		rev := leased("parts-raw/cad")
		timed(&cad, func() error {
			_, err := cli.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision("parts-raw/cad"), "=", rev)).Then(clientv3.OpDelete("parts-raw/cad")).Commit()
			return err
		})
		leased("parts-raw/del")
		timed(&del, func() error { _, err := cli.Delete(ctx, "parts-raw/del"); return err })
	}
	b.StopTimer()
	p50 := func(d []time.Duration) float64 {
		slices.Sort(d)
		return float64(d[len(d)/2]) / float64(time.Microsecond)
	}
	for i, l := range libs {
		b.ReportMetric(p50(locks[i]), l.name+"-lock-p50-us")
		b.ReportMetric(p50(unlocks[i]), l.name+"-unlock-p50-us")
	}
	b.ReportMetric(p50(cad), "compare-and-delete-p50-us")
	b.ReportMetric(p50(del), "delete-p50-us")
}

// TryLock on a held lock.
func BenchmarkTryLockHeld(b *testing.B) {
	for _, l := range libs {
		b.Run(l.name, func(b *testing.B) {
			cli, cnt, admin := benchEtcd(b)
			ctx := context.Background()
			must(b, l.newMutex(b, admin, "bench-try").Lock(ctx))
			m := l.newMutex(b, cli, "bench-try")
			start := storeRev(b, admin)
			cnt.take()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if err := m.TryLock(ctx); err == nil {
					b.Fatal("TryLock took a held lock")
				}
			}
			b.StopTimer()
			n, _ := cnt.take()
			b.ReportMetric(float64(n)/float64(b.N), "rpcs/op")
			b.ReportMetric(float64(storeRev(b, admin)-start)/float64(b.N), "writes/op")
		})
	}
}

// Uncontended Campaign, Proclaim, Resign.
func BenchmarkCampaignProclaimResign(b *testing.B) {
	for _, l := range libs {
		b.Run(l.name, func(b *testing.B) {
			cli, cnt, admin := benchEtcd(b)
			ctx := context.Background()
			e := l.newElection(b, cli, "bench-elect")
			var campaign, proclaim, resign int64
			start := storeRev(b, admin)
			cnt.take()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				must(b, e.Campaign(ctx, "a"))
				n, _ := cnt.take()
				campaign += n
				must(b, e.Proclaim(ctx, "b"))
				n, _ = cnt.take()
				proclaim += n
				must(b, e.Resign(ctx))
				n, _ = cnt.take()
				resign += n
			}
			b.StopTimer()
			b.ReportMetric(float64(campaign)/float64(b.N), "campaign-rpcs/op")
			b.ReportMetric(float64(proclaim)/float64(b.N), "proclaim-rpcs/op")
			b.ReportMetric(float64(resign)/float64(b.N), "resign-rpcs/op")
			b.ReportMetric(float64(storeRev(b, admin)-start)/float64(b.N), "writes/op")
		})
	}
}

// A queued waiter's Lock, split at its predecessor's delete event: RPCs
// before (enqueue and setting up the wait) and after (taking the turn), for
// a waiter with one key ahead and with two (the older released first).
func BenchmarkWaiterCost(b *testing.B) {
	for _, l := range libs {
		for _, ahead := range []int{1, 2} {
			b.Run(fmt.Sprintf("%s/ahead=%d", l.name, ahead), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				admin := c.Client(b)
				cnt := counter{created: make(chan struct{}, 16)}
				cli := c.Client(b, cnt.dial()...)
				ctx := context.Background()
				holders := make([]benchMutex, ahead)
				for i := range holders {
					holders[i] = l.newMutex(b, admin, "bench-waiter")
				}
				m := l.newMutex(b, cli, "bench-waiter")
				var before, after int64
				for i := 0; i < b.N; i++ {
					locked := make([]chan error, ahead)
					for j, h := range holders {
						locked[j] = make(chan error, 1)
						go func() { locked[j] <- h.Lock(ctx) }()
						waitKeys(b, admin, "bench-waiter/", j+1)
					}
					cnt.take()
					got := make(chan error, 1)
					go func() { got <- m.Lock(ctx) }()
					for w := 0; w < l.watches(ahead); w++ { // the waiter is in its watch
						<-cnt.created
					}
					n, _ := cnt.take()
					before += n
					for j, h := range holders { // release oldest first
						must(b, <-locked[j])
						must(b, h.Unlock(ctx))
					}
					must(b, <-got)
					n, _ = cnt.take()
					after += n
					must(b, m.Unlock(ctx))
				}
				b.ReportMetric(float64(before)/float64(b.N), "before-rpcs/op")
				b.ReportMetric(float64(after)/float64(b.N), "after-event-rpcs/op")
			})
		}
	}
}

// The floor of a handoff: one delete committed plus its watch event
// delivered to another client, on a raw watch stream (as a waiter reads it)
// that watches the key from before the put and stays open: no client
// goroutine between the server and the reader, nothing set up per sample.
func BenchmarkFloor(b *testing.B) {
	watcher, _, admin := benchEtcd(b)
	benchFloorAt(b, watcher.Endpoints()[0], admin)
}

// benchFloorAt measures the floor (see BenchmarkFloor) on the server at ep,
// its deletes made by admin.
func benchFloorAt(b *testing.B, ep string, admin *clientv3.Client) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ws, err := pb.NewWatchClient(etcdtest.Conn(b, ep)).Watch(ctx)
	must(b, err)
	must(b, ws.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{CreateRequest: &pb.WatchCreateRequest{
		Key: []byte("floor"), Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT}}}}))
	created, err := ws.Recv()
	must(b, err)
	if !created.Created {
		b.Fatalf("first response on the floor's watch: %v", created)
	}
	var samples []time.Duration
	b.ResetTimer()
	for range b.N {
		_, err := admin.Put(ctx, "floor", "x")
		must(b, err)
		start := time.Now()
		_, err = admin.Delete(ctx, "floor")
		must(b, err)
		for {
			resp, err := ws.Recv()
			must(b, err)
			if len(resp.Events) > 0 {
				break
			}
		}
		samples = append(samples, time.Since(start))
	}
	b.StopTimer()
	reportLatency(b, samples, "floor-")
}

// Where a handoff's time goes, one waiter (etcdsync), each part on its own
// clock readings (no timer call, which stops the world, among them): the
// holder's Unlock start to its Txn leaving the client (unlock-client); to
// the delete's event coming off the waiter's watch stream (unlock-to-event:
// that and the server's commit and event); from there to the waiter's Lock
// return (event-to-lock: the waiter's client). Beside it, in the same rounds
// and so the same conditions, a plain delete (floor) and a compare-and-delete
// Txn (txn-floor) of an unleased key, each to its event coming off a watch
// stream of the waiter's client.
func BenchmarkHandoffParts(b *testing.B) {
	_, _, admin := benchEtcd(b)
	cnt := counter{created: make(chan struct{}, 16)}
	cli := etcdtest.NewClient(b, admin.Endpoints(), cnt.dial()...)
	var sent atomic.Int64 // when the holder's client last sent a unary request (UnixNano)
	hcli := etcdtest.NewClient(b, admin.Endpoints(), grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		sent.Store(time.Now().UnixNano())
		return invoker(ctx, method, req, reply, cc, opts...)
	}))
	ctx := context.Background()
	holder := etcdsync.NewMutex(session(b, hcli), "bench-parts")
	waiter := etcdsync.NewMutex(session(b, cli), "bench-parts")
	floor := cli.Watch(ctx, "floor", clientv3.WithFilterPut(), clientv3.WithCreatedNotify())
	<-floor
	<-cnt.created
	since := func(start time.Time, at *atomic.Int64) time.Duration { return time.Unix(0, at.Load()).Sub(start) }
	var total, unlockClient, unlockToEvent, eventToLock, floorS, txnFloor []time.Duration
	b.ResetTimer() // ns/op is the whole round
	for range b.N {
		must(b, holder.Lock(ctx))
		got := make(chan time.Time, 1)
		lockErr := make(chan error, 1)
		go func() { // joined below: it sends its Lock's error, then its time
			err := waiter.Lock(ctx)
			at := time.Now()
			lockErr <- err
			got <- at
		}()
		<-cnt.created // the waiter's watch of the prefix
		start := time.Now()
		must(b, holder.Unlock(ctx))
		must(b, <-lockErr)
		end := <-got
		total = append(total, end.Sub(start))
		unlockClient = append(unlockClient, since(start, &sent))
		unlockToEvent = append(unlockToEvent, since(start, &cnt.lastEvents))
		eventToLock = append(eventToLock, -since(end, &cnt.lastEvents))
		must(b, waiter.Unlock(ctx))

		_, err := admin.Put(ctx, "floor", "x")
		must(b, err)
		start = time.Now()
		_, err = admin.Delete(ctx, "floor")
		must(b, err)
		<-floor
		floorS = append(floorS, since(start, &cnt.lastEvents))

		p, err := admin.Put(ctx, "floor", "x")
		must(b, err)
		start = time.Now()
		_, err = admin.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision("floor"), "=", p.Header.Revision)).Then(clientv3.OpDelete("floor")).Commit()
		must(b, err)
		<-floor
		txnFloor = append(txnFloor, since(start, &cnt.lastEvents))
	}
	reportLatency(b, total, "handoff-")
	reportLatency(b, unlockClient, "unlock-client-")
	reportLatency(b, unlockToEvent, "unlock-to-event-")
	reportLatency(b, eventToLock, "event-to-lock-")
	reportLatency(b, floorS, "floor-")
	reportLatency(b, txnFloor, "txn-floor-")
}

// The floor as etcd's client sees it: the same, through clientv3.Watch (its
// goroutines between the stream and the reader), a watch set up per sample.
func BenchmarkFloorClientWatch(b *testing.B) {
	watcher, _, admin := benchEtcd(b)
	var samples []time.Duration
	ctx := context.Background()
	for i := 0; i < b.N; i++ {
		p, err := admin.Put(ctx, "floor", "x")
		must(b, err)
		wctx, cancel := context.WithCancel(ctx)
		wch := watcher.Watch(wctx, "floor", clientv3.WithRev(p.Header.Revision+1), clientv3.WithCreatedNotify())
		<-wch // created: synced
		start := time.Now()
		_, err = admin.Delete(ctx, "floor")
		must(b, err)
		for wr := range wch {
			if len(wr.Events) > 0 {
				break
			}
		}
		samples = append(samples, time.Since(start))
		cancel()
	}
	reportLatency(b, samples, "floor-")
}

// Handoff latency with N waiters queued: holder's Unlock start to the next
// waiter's Lock return. N waiters queue (each in its watch) behind a holder;
// then each new holder unlocks at once, and the first half of the chain is
// sampled (so the queue is between N and N/2 long), round after round. The
// holder and the waiters are made once (sessions, keepalive streams and
// connections warm) and lock again in every round. Counted over each
// round's whole chain (N handoffs, not only the sampled half):
//   - events/release: the watch events the waiters' client received from
//     the holder's Unlock start to the last waiter's Lock return, over the
//     N releases in it (the holder's and N-1 waiters').
//   - total-rpcs/handoff: the unary RPCs the waiters' client made from the
//     holder's Unlock start to the chain's end, per handoff: each waiter's
//     Unlock once it held (1 RPC) and what waiting took once the release
//     came (our waiter's read when a key it watches goes and it is not yet
//     at the front; etcd's waiter's reads of the keys ahead and of its own).
//   - rpcs/handoff: the same without the Unlocks (total less 1 per handoff).
func BenchmarkHandoff(b *testing.B) {
	for _, n := range []int{1, 10, 100, 500, 1000} {
		for _, l := range libs {
			b.Run(fmt.Sprintf("N=%d/%s", n, l.name), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				benchHandoff(b, l, n, 0, c.Client(b), c.Endpoints())
			})
		}
	}
}

// Handoff as in BenchmarkHandoff (the same figures), the waiters' client
// reaching etcd through etcd's gRPC proxy (served in process). The first
// round is neither sampled nor counted: it is where a client learns that
// the proxy does not answer progress requests (first-handoff-ms).
func BenchmarkHandoffProxy(b *testing.B) {
	for _, n := range []int{1, 10} {
		for _, l := range libs {
			b.Run(fmt.Sprintf("N=%d/%s", n, l.name), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				benchHandoff(b, l, n, 0, c.Client(b), []string{etcdtest.StartGRPCProxy(b, c.Endpoints())})
			})
		}
	}
}

// benchHandoff runs BenchmarkHandoff's rounds and reports its figures: the
// holder on admin, n waiters on one counted client of endpoints, all on the
// name bench-handoff of l's lock. stay more of l's locks (a Semaphore's
// other permits) are taken on admin first and held throughout, so that
// the holder's key and stay keys are ahead of the first waiter. Through a
// proxy (endpoints other than admin's) one round goes first, unsampled and
// uncounted.
func benchHandoff(b *testing.B, l lib, n, stay int, admin *clientv3.Client, endpoints []string) {
	cnt := counter{created: make(chan struct{}, queueWatchesBehind(l, stay+1, n)+16)}
	cli := etcdtest.NewClient(b, endpoints, cnt.dial()...)
	for range stay {
		must(b, l.newMutex(b, admin, "bench-handoff").Lock(context.Background()))
	}
	holder := l.newMutex(b, admin, "bench-handoff")
	waiters := make([]benchMutex, n)
	for i := range waiters {
		waiters[i] = l.newMutex(b, cli, "bench-handoff")
	}
	var first []time.Duration
	if !slices.Equal(endpoints, admin.Endpoints()) {
		first = handoffQueue(b, admin, holder, waiters, &cnt, l, stay).samples
	}
	var samples []time.Duration
	var events, rpcs, handoffs int64
	b.ResetTimer() // it drops metrics reported before
	for len(samples) < b.N {
		r := handoffQueue(b, admin, holder, waiters, &cnt, l, stay)
		samples = append(samples, r.samples...)
		events, rpcs, handoffs = events+r.events, rpcs+r.rpcs, handoffs+int64(n)
	}
	b.StopTimer()
	reportLatency(b, samples[:b.N], "handoff-")
	b.ReportMetric(float64(events)/float64(handoffs), "events/release")
	b.ReportMetric(float64(rpcs)/float64(handoffs), "total-rpcs/handoff")
	b.ReportMetric(float64(rpcs-handoffs)/float64(handoffs), "rpcs/handoff")
	if first != nil {
		b.ReportMetric(float64(first[0])/float64(time.Millisecond), "first-handoff-ms")
	}
}

// pollKeys waits, at most testTimeout, until at least n keys are under
// prefix, reading only. It is not waitKeys on purpose: waitKeys watches, and
// a watch's teardown (its cancel, the server's and the client's work to end
// it) would run on into the handoff that handoffQueue samples next.
func pollKeys(b *testing.B, cli *clientv3.Client, prefix string, n int) {
	deadline := time.Now().Add(testTimeout)
	for {
		resp, err := cli.Get(context.Background(), prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
		must(b, err)
		if resp.Count >= int64(n) {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("%d keys under %s, waited for %d", resp.Count, prefix, n)
		}
		time.Sleep(100 * time.Microsecond)
	}
}

// queueWatches is the number of watches n waiters queued behind a holder create.
func queueWatches(l lib, n int) int { return queueWatchesBehind(l, 1, n) }

// queueWatchesBehind is the number of watches n waiters queued behind held
// keys that block them create (the i-th, from 0, lists held+i keys ahead).
func queueWatchesBehind(l lib, held, n int) int {
	total := 0
	for i := range n {
		total += l.watches(held + i)
	}
	return total
}

// handoffRound is what one round of handoffQueue measured.
type handoffRound struct {
	samples []time.Duration // the first max(1, n/2) handoff latencies
	events  int64           // watch events to the waiters' client, the holder's Unlock start to the last waiter's Lock return
	rpcs    int64           // unary RPCs of the waiters' client, the holder's Unlock start to the chain's end (the waiters' Unlocks included)
}

// handoffQueue queues the waiters behind the holder (and stay keys held
// before it), releases the holder and lets the chain run, each new holder
// unlocking after -hold (at once by default); it returns the first
// max(1, n/2) handoff latencies and the chain's counts (handoffRound).
// It calls no timer method (b.StartTimer reads the memory statistics, which
// stops the world, the embedded server's goroutines included: in
// BenchmarkHandoffParts, timer calls in a round raised its handoff's p50
// from 0.24 to 0.43 ms with fsync off), it waits for the queue by reading
// (pollKeys), not watching, and during the chain it counts with atomic
// loads alone.
func handoffQueue(b *testing.B, admin *clientv3.Client, holder benchMutex, waiters []benchMutex, cnt *counter, l lib, stay int) handoffRound {
	ctx := context.Background()
	n := len(waiters)
	must(b, holder.Lock(ctx))
	for len(cnt.created) > 0 { // the last round's later watches
		<-cnt.created
	}
	var (
		mu        sync.Mutex
		samples   []time.Duration
		lastStart time.Time
		wg        sync.WaitGroup
		locked    atomic.Int64 // waiters whose Lock returned
		events    atomic.Int64 // cnt.events when the last one's did
	)
	for i, m := range waiters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := m.Lock(ctx); err != nil {
				b.Error(err)
				return
			}
			held := time.Now()
			if locked.Add(1) == int64(n) {
				events.Store(cnt.events.Load())
			}
			if *benchHold > 0 {
				time.Sleep(*benchHold) // the holder's work
			}
			mu.Lock()
			samples = append(samples, held.Sub(lastStart))
			lastStart = time.Now()
			mu.Unlock()
			if err := m.Unlock(ctx); err != nil {
				b.Error(err)
			}
		}()
		if i < 10 || i%50 == 0 {
			pollKeys(b, admin, "bench-handoff/", stay+i+2) // queue in order
		}
	}
	// every waiter in its watch
	waitWatches(b, cnt, queueWatchesBehind(l, stay+1, n), nil, nil)
	cnt.take()
	events0 := cnt.events.Load()
	mu.Lock()
	lastStart = time.Now()
	mu.Unlock()
	must(b, holder.Unlock(ctx))
	wg.Wait()
	rpcs, _ := cnt.take()
	return handoffRound{samples: samples[:max(1, n/2)], events: events.Load() - events0, rpcs: rpcs}
}

// Handoff under steady contention: N+1 contenders loop Lock, Unlock, Lock
// again, so the queue stays N long and the released holder's next enqueue
// competes with the handoff.
func BenchmarkHandoffSteady(b *testing.B) {
	for _, n := range []int{1, 10, 100, 500} {
		for _, l := range libs {
			b.Run(fmt.Sprintf("N=%d/%s", n, l.name), func(b *testing.B) {
				_, _, admin := benchEtcd(b)
				samples := handoffChain(b, admin, l, n)
				reportLatency(b, samples, "handoff-")
			})
		}
	}
}

// handoffChain runs b.N handoffs among n+1 contenders and returns the samples.
// Sampling starts once all n+1 are queued.
func handoffChain(b *testing.B, cli *clientv3.Client, l lib, n int) []time.Duration {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ms := make([]benchMutex, n+1)
	for i := range ms {
		ms[i] = l.newMutex(b, cli, "bench-handoff")
	}
	first := ms[0]
	must(b, first.Lock(ctx))
	var (
		mu        sync.Mutex
		samples   []time.Duration
		lastStart time.Time // when the last holder began its Unlock
		left      = int64(b.N)
		wg        sync.WaitGroup
	)
	contend := func(m benchMutex, held bool) {
		defer wg.Done()
		for {
			if !held {
				if err := m.Lock(ctx); err != nil {
					return
				}
			}
			held = false
			now := time.Now()
			mu.Lock()
			if !lastStart.IsZero() {
				samples = append(samples, now.Sub(lastStart))
			}
			done := atomic.AddInt64(&left, -1) < 0
			lastStart = time.Now()
			mu.Unlock()
			if done {
				cancel()
			}
			if err := m.Unlock(context.Background()); err != nil || done {
				return
			}
		}
	}
	for _, m := range ms[1:] {
		wg.Add(1)
		go contend(m, false)
	}
	waitKeys(b, cli, "bench-handoff/", n+1)
	b.ResetTimer()
	wg.Add(1)
	go contend(first, true)
	wg.Wait()
	b.StopTimer()
	if len(samples) > b.N {
		samples = samples[:b.N]
	}
	return samples
}

// Election handoff: Resign to the next Campaign's return, two candidates.
func BenchmarkElectionHandoff(b *testing.B) {
	for _, l := range libs {
		b.Run(l.name, func(b *testing.B) {
			c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
			cnt := counter{created: make(chan struct{}, 16)}
			cli := c.Client(b, cnt.dial()...)
			ctx := context.Background()
			es := []benchElection{l.newElection(b, cli, "bench-eh"), l.newElection(b, cli, "bench-eh")}
			must(b, es[0].Campaign(ctx, "0"))
			var samples []time.Duration
			for i := 0; i < b.N; i++ {
				leader, next := es[i%2], es[(i+1)%2]
				got := make(chan error, 1)
				go func() { got <- next.Campaign(ctx, "x") }()
				for w := 0; w < l.watches(1); w++ { // the candidate is in its watch
					<-cnt.created
				}
				start := time.Now()
				must(b, leader.Resign(ctx))
				must(b, <-got)
				samples = append(samples, time.Since(start))
			}
			reportLatency(b, samples, "handoff-")
		})
	}
}

// Watch events delivered to all waiters per release, with N queued.
func BenchmarkEventsPerRelease(b *testing.B) {
	for _, n := range []int{10, 100, 1000} {
		for _, l := range libs {
			b.Run(fmt.Sprintf("N=%d/%s", n, l.name), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				admin := c.Client(b)
				cnt := counter{created: make(chan struct{}, queueWatches(l, n)+16)}
				cli := c.Client(b, cnt.dial()...)
				var releases atomic.Int64
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				holder := l.newMutex(b, admin, "bench-events")
				must(b, holder.Lock(ctx))
				var wg sync.WaitGroup
				order := make(chan benchMutex, n)
				for i := 0; i < n; i++ {
					m := l.newMutex(b, cli, "bench-events")
					wg.Add(1)
					go func() {
						defer wg.Done()
						if m.Lock(ctx) == nil {
							order <- m
						}
					}()
				}
				for w := 0; w < queueWatches(l, n); w++ { // every waiter in its watch
					<-cnt.created
				}
				before := cnt.events.Load()
				b.ResetTimer()
				must(b, holder.Unlock(context.Background()))
				releases.Add(1)
				for i := 1; i < b.N && i < n; i++ {
					must(b, (<-order).Unlock(context.Background()))
					releases.Add(1)
				}
				got := <-order // the last handoff's waiter took the lock
				b.StopTimer()
				events := cnt.events.Load() - before
				b.ReportMetric(float64(events)/float64(releases.Load()), "events/release")
				must(b, got.Unlock(context.Background()))
				cancel()
				wg.Wait()
			})
		}
	}
}

// Throughput: 64 goroutines lock and unlock distinct names, against raw
// put+delete pairs, etcd's Mutex, and etcd's Mutex with a fenced release.
func BenchmarkThroughput64(b *testing.B) {
	const workers = 64
	run := func(b *testing.B, op func(i int) error) {
		var next atomic.Int64
		var wg sync.WaitGroup
		b.ResetTimer()
		start := time.Now()
		for w := 0; w < workers; w++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for next.Add(1) <= int64(b.N) {
					if err := op(w); err != nil {
						b.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
		b.StopTimer()
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "ops/s")
	}
	b.Run("raw-put-delete", func(b *testing.B) {
		_, _, admin := benchEtcd(b)
		ctx := context.Background()
		run(b, func(i int) error {
			k := fmt.Sprintf("raw/%d", i)
			if _, err := admin.Put(ctx, k, ""); err != nil {
				return err
			}
			_, err := admin.Delete(ctx, k)
			return err
		})
	})
	for _, l := range libs {
		b.Run(l.name, func(b *testing.B) {
			_, _, admin := benchEtcd(b)
			ctx := context.Background()
			ms := make([]benchMutex, workers)
			for i := range ms {
				ms[i] = l.newMutex(b, admin, fmt.Sprintf("tp/%d", i))
			}
			run(b, func(i int) error {
				if err := ms[i].Lock(ctx); err != nil {
					return err
				}
				return ms[i].Unlock(ctx)
			})
		})
	}
	// etcd's Mutex released as ours is, only while the key is still this
	// hold's: the part of the gap that is the fence's.
	b.Run("concurrency-fenced", func(b *testing.B) {
		_, _, admin := benchEtcd(b)
		ctx := context.Background()
		ms := make([]*concurrency.Mutex, workers)
		for i := range ms {
			ms[i] = concurrency.NewMutex(theirSession(b, admin), fmt.Sprintf("tp/%d", i))
		}
		run(b, func(i int) error {
			m := ms[i]
			if err := m.Lock(ctx); err != nil {
				return err
			}
			// Uncontended, the Lock's header is the create's: its revision
			// is the key's create revision.
			resp, err := admin.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(m.Key()), "=", m.Header().Revision)).
				Then(clientv3.OpDelete(m.Key())).Commit()
			if err == nil && !resp.Succeeded {
				err = fmt.Errorf("%s: not released", m.Key())
			}
			return err
		})
	})
}

// Client allocations per operation (etcd in a child process, so that only
// the client's count): uncontended Lock+Unlock, TryLock on a held lock,
// Campaign+Resign.
func BenchmarkClientAllocs(b *testing.B) {
	for _, l := range libs {
		b.Run("lock-unlock/"+l.name, func(b *testing.B) {
			m := l.newMutex(b, clientOfChildEtcd(b), "allocs")
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				must(b, m.Lock(ctx))
				must(b, m.Unlock(ctx))
			}
		})
		b.Run("trylock-held/"+l.name, func(b *testing.B) {
			cli := clientOfChildEtcd(b)
			ctx := context.Background()
			must(b, l.newMutex(b, cli, "allocs").Lock(ctx))
			m := l.newMutex(b, cli, "allocs")
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if m.TryLock(ctx) == nil {
					b.Fatal("TryLock took a held lock")
				}
			}
		})
		b.Run("campaign-resign/"+l.name, func(b *testing.B) {
			e := l.newElection(b, clientOfChildEtcd(b), "allocs")
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				must(b, e.Campaign(ctx, "v"))
				must(b, e.Resign(ctx))
			}
		})
	}
}

// Observability's cost: Lock+Unlock on sessions with no logger and no
// metrics (as before WithLogger/WithMetrics existed), with a logger whose
// handler drops Debug (the default level), one that formats every record,
// with metrics, and with both. etcd runs in a child process (client side
// allocations only).
func BenchmarkObservabilityCost(b *testing.B) {
	metrics := func() *etcdsync.Metrics {
		m, err := etcdsync.NewMetrics(prometheus.NewRegistry())
		must(b, err)
		return m
	}
	text := func(level slog.Level) *slog.Logger {
		return slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: level}))
	}
	cases := []struct {
		name string
		opts func() []etcdsync.SessionOption
	}{
		{"off", func() []etcdsync.SessionOption { return nil }},
		{"logger-info", func() []etcdsync.SessionOption {
			return []etcdsync.SessionOption{etcdsync.WithLogger(text(slog.LevelInfo))}
		}},
		{"logger-debug", func() []etcdsync.SessionOption {
			return []etcdsync.SessionOption{etcdsync.WithLogger(text(slog.LevelDebug))}
		}},
		{"metrics", func() []etcdsync.SessionOption { return []etcdsync.SessionOption{etcdsync.WithMetrics(metrics())} }},
		{"both-debug", func() []etcdsync.SessionOption {
			return []etcdsync.SessionOption{etcdsync.WithLogger(text(slog.LevelDebug)), etcdsync.WithMetrics(metrics())}
		}},
	}
	cli := clientOfChildEtcd(b)
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			s, err := etcdsync.NewSession(cli, c.opts()...)
			must(b, err)
			defer s.Close()
			m := etcdsync.NewMutex(s, "observe")
			ctx := context.Background()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				must(b, m.Lock(ctx))
				must(b, m.Unlock(ctx))
			}
		})
	}
}

// Scale: one session holding 10,000 locks nobody asked Done of: heap and
// goroutines per held lock. etcd runs in a child process here, so that the
// heap counts the client side only.
func BenchmarkHold10k(b *testing.B) {
	const locks = 10000
	// Each library: one session's maker of Mutexes, and its Close.
	type oneSession func(b *testing.B, cli *clientv3.Client) (newMutex func(name string) benchMutex, close func() error)
	for _, l := range []struct {
		name string
		open oneSession
	}{
		{"etcdsync", func(b *testing.B, cli *clientv3.Client) (func(string) benchMutex, func() error) {
			s := session(b, cli)
			return func(name string) benchMutex { return etcdsync.NewMutex(s, name) }, s.Close
		}},
		{"concurrency", func(b *testing.B, cli *clientv3.Client) (func(string) benchMutex, func() error) {
			s := theirSession(b, cli)
			return func(name string) benchMutex { return concurrency.NewMutex(s, name) }, s.Close
		}},
	} {
		b.Run(l.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				newMutex, closeSession := l.open(b, clientOfChildEtcd(b))
				ms := make([]benchMutex, locks)
				names := make([]string, locks)
				for j := range names {
					names[j] = fmt.Sprintf("scale/%d", j)
				}
				runtime.GC()
				var before runtime.MemStats
				runtime.ReadMemStats(&before)
				g0 := runtime.NumGoroutine()
				var next atomic.Int64
				var wg sync.WaitGroup
				var failed atomic.Value
				for w := 0; w < 64; w++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for j := next.Add(1) - 1; j < locks; j = next.Add(1) - 1 {
							ms[j] = newMutex(names[j])
							if err := ms[j].Lock(context.Background()); err != nil {
								failed.Store(err)
								return
							}
						}
					}()
				}
				wg.Wait()
				if err, _ := failed.Load().(error); err != nil {
					b.Fatal(err)
				}
				runtime.GC()
				var after runtime.MemStats
				runtime.ReadMemStats(&after)
				heap := float64(after.HeapAlloc) - float64(before.HeapAlloc)
				b.ReportMetric(heap/locks, "heap-bytes/lock")
				b.ReportMetric(heap/(1<<20), "heap-MiB")
				b.ReportMetric(float64(runtime.NumGoroutine()-g0)/locks, "goroutines/lock")
				runtime.KeepAlive(ms)
				must(b, closeSession())
			}
		})
	}
}

// clientOfChildEtcd starts an embedded etcd in a child process (this test
// binary, running TestChildEtcd) and returns a client of it; both end in b's
// cleanup.
func clientOfChildEtcd(b *testing.B) *clientv3.Client {
	return etcdtest.NewClient(b, childEtcd(b, false))
}

// childEtcd starts an embedded etcd member, with fsync on or off, in a child
// process (this test binary, running TestChildEtcd), so that the heap and
// goroutines of this process are the clients' only, and returns its
// endpoints. The member ends in b's cleanup.
func childEtcd(b *testing.B, fsync bool) []string {
	cmd := exec.Command(os.Args[0], "-test.run=^TestChildEtcd$")
	cmd.Env = append(os.Environ(), "ETCDSYNC_CHILD_ETCD="+b.TempDir(), fmt.Sprintf("ETCDSYNC_CHILD_FSYNC=%t", fsync))
	stdin, err := cmd.StdinPipe()
	must(b, err)
	stdout, err := cmd.StdoutPipe()
	must(b, err)
	must(b, cmd.Start())
	b.Cleanup(func() { stdin.Close(); cmd.Wait() })
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if ep, ok := strings.CutPrefix(sc.Text(), "ENDPOINT "); ok {
			go io.Copy(io.Discard, stdout)
			return []string{ep}
		}
	}
	b.Fatal("child etcd printed no endpoint")
	return nil
}

// TestChildEtcd serves an embedded etcd for childEtcd until its standard
// input closes, with fsync on when ETCDSYNC_CHILD_FSYNC is true; without
// ETCDSYNC_CHILD_ETCD it is skipped.
func TestChildEtcd(t *testing.T) {
	dir := os.Getenv("ETCDSYNC_CHILD_ETCD")
	if dir == "" {
		t.Skip("runs only as a benchmark's child process")
	}
	c, err := etcdtest.StartCluster(dir, etcdtest.Options{Fsync: os.Getenv("ETCDSYNC_CHILD_FSYNC") == "true"})
	require.NoError(t, err)
	defer c.Close()
	fmt.Println("ENDPOINT " + c.Endpoints()[0])
	io.Copy(io.Discard, os.Stdin)
}

// RWMutex, ours and etcd's experimental recipe side by side.
type benchRW interface {
	RLock(context.Context) error
	RUnlock(context.Context) error
	Lock(context.Context) error
	Unlock(context.Context) error
}

// recipeRW adapts etcd's recipe RWMutex, which takes no context.
type recipeRW struct{ rw *recipe.RWMutex }

func (r recipeRW) RLock(context.Context) error   { return r.rw.RLock() }
func (r recipeRW) RUnlock(context.Context) error { return r.rw.RUnlock() }
func (r recipeRW) Lock(context.Context) error    { return r.rw.Lock() }
func (r recipeRW) Unlock(context.Context) error  { return r.rw.Unlock() }

// rwLib is an RWMutex implementation under benchmark, and the watches its
// waiters create.
type rwLib struct {
	name          string
	readerWatches func(n int) int     // watches n readers queued behind one writer create
	writerWatches func(ahead int) int // watches a writer with ahead writers' keys listed before its own creates
	newRW         func(b *testing.B, cli *clientv3.Client, name string) benchRW
}

var rwLibs = []rwLib{
	{"etcdsync",
		func(n int) int { return waits(1, 1)*min(n, 2) + 2*max(0, n-2) }, // the first two the prefix, the others their own key and the writer's
		func(ahead int) int { return waits(ahead, 1) },                   // as a Mutex's waiter
		func(b *testing.B, cli *clientv3.Client, name string) benchRW {
			return etcdsync.NewRWMutex(session(b, cli), name)
		}},
	{"recipe",
		func(n int) int { return n },     // the last writer's key before its own
		func(ahead int) int { return 1 }, // the last key before its own
		func(b *testing.B, cli *clientv3.Client, name string) benchRW {
			return recipeRW{recipe.NewRWMutex(theirSession(b, cli), name)}
		}},
}

// writers is l's write side as a lib, for benchHandoff.
func (l rwLib) writers() lib {
	return lib{
		name:    l.name,
		watches: l.writerWatches,
		newMutex: func(b *testing.B, cli *clientv3.Client, name string) benchMutex {
			return writeSide{l.newRW(b, cli, name)}
		},
	}
}

// writeSide is an RWMutex's Lock and Unlock as a benchMutex. It has no
// TryLock (etcd's recipe has none; the handoff benchmarks make no try).
type writeSide struct{ benchRW }

func (writeSide) TryLock(context.Context) error { return errors.New("writeSide: no TryLock") }

// Uncontended read and write holds: RPCs and writes per lock+unlock.
func BenchmarkRWMutexUncontended(b *testing.B) {
	for _, l := range rwLibs {
		for _, mode := range []string{"read", "write"} {
			b.Run(mode+"/"+l.name, func(b *testing.B) {
				cli, cnt, admin := benchEtcd(b)
				rw := l.newRW(b, cli, "bench-rw")
				ctx := context.Background()
				lock, unlock := rw.Lock, rw.Unlock
				if mode == "read" {
					lock, unlock = rw.RLock, rw.RUnlock
				}
				cnt.take()
				before := storeRev(b, admin)
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					must(b, lock(ctx))
					must(b, unlock(ctx))
				}
				b.StopTimer()
				n, _ := cnt.take()
				b.ReportMetric(float64(n)/float64(b.N), "rpcs/op")
				b.ReportMetric(float64(storeRev(b, admin)-before)/float64(b.N), "writes/op")
			})
		}
	}
}

// RWMutex handoffs, ours beside etcd's recipe.
//   - readers/N: a writer's release with N readers queued behind it (each in
//     its watch): all-readers-p50/p90 from the writer's Unlock start to the
//     last reader's RLock return; events/release, the watch events the
//     readers' client received meanwhile; after-release-rpcs/op, its unary
//     RPCs meanwhile.
//   - writers/N: BenchmarkHandoff's chain (its figures: handoff-p50/p90,
//     events/release, rpcs/handoff, total-rpcs/handoff) on the write side:
//     N writers queued behind a writer, each new holder unlocking at once.
func BenchmarkRWHandoff(b *testing.B) {
	for _, n := range []int{1, 10, 100, 1000} {
		for _, l := range rwLibs {
			b.Run(fmt.Sprintf("readers/N=%d/%s", n, l.name), func(b *testing.B) { benchRWReaders(b, l, n) })
		}
	}
	for _, n := range []int{1, 10, 100, 500, 1000} {
		for _, l := range rwLibs {
			b.Run(fmt.Sprintf("writers/N=%d/%s", n, l.name), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				benchHandoff(b, l.writers(), n, 0, c.Client(b), c.Endpoints())
			})
		}
	}
}

// benchRWReaders runs BenchmarkRWHandoff's readers/N rounds. Like
// handoffQueue it calls no timer method in a round (ns/op is the whole
// round, set-up included).
func benchRWReaders(b *testing.B, l rwLib, n int) {
	c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
	admin := c.Client(b)
	cnt := counter{created: make(chan struct{}, l.readerWatches(n)+16)}
	cli := c.Client(b, cnt.dial()...)
	ctx := context.Background()
	w := l.newRW(b, admin, "bench-rwh")
	readers := make([]benchRW, n)
	for i := range readers {
		readers[i] = l.newRW(b, cli, "bench-rwh")
	}
	var samples []time.Duration
	var events, rpcs int64
	b.ResetTimer()
	for range b.N {
		must(b, w.Lock(ctx))
		for len(cnt.created) > 0 { // the last round's later watches
			<-cnt.created
		}
		var wg sync.WaitGroup
		for _, r := range readers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := r.RLock(ctx); err != nil {
					b.Error(err)
				}
			}()
		}
		// Every reader queued (a reaper's watch of the last round, closing
		// a wait's stream, may count as one created) and in its watch.
		pollKeys(b, admin, "bench-rwh/", n+1)
		waitWatches(b, &cnt, l.readerWatches(n), nil, nil)
		cnt.take()
		ev := cnt.events.Load()
		start := time.Now()
		must(b, w.Unlock(ctx))
		wg.Wait()
		samples = append(samples, time.Since(start))
		events += cnt.events.Load() - ev
		k, _ := cnt.take()
		rpcs += k
		for _, r := range readers {
			must(b, r.RUnlock(ctx))
		}
	}
	b.StopTimer()
	reportLatency(b, samples, "all-readers-")
	b.ReportMetric(float64(events)/float64(b.N), "events/release")
	b.ReportMetric(float64(rpcs)/float64(b.N), "after-release-rpcs/op")
}

// Semaphore handoff with N waiters queued: BenchmarkHandoff's chain and
// figures (handoff-p50/p90 from a Release start to the next Acquire return,
// events/release, rpcs/handoff, total-rpcs/handoff) on a Semaphore of
// capacity 4, one permit each: 4 holders (3 of them hold throughout), N
// waiters queued behind them, then the newest holder releases and each
// admitted waiter releases at once. etcd's client has no Semaphore: compare
// with BenchmarkFloor of the same run. (It replaces
// BenchmarkSemaphoreEventsPerRelease: its events/release is that figure.)
func BenchmarkSemaphoreHandoff(b *testing.B) {
	const capacity = 4
	l := lib{
		name:    "etcdsync",
		watches: func(ahead int) int { return waits(ahead, capacity) }, // the prefix, or own key and a run of capacity keys
		newMutex: func(b *testing.B, cli *clientv3.Client, name string) benchMutex {
			return permit{etcdsync.NewSemaphore(session(b, cli), name, capacity)}
		},
	}
	for _, n := range []int{1, 10, 100, 500, 1000} {
		b.Run(fmt.Sprintf("N=%d/%s", n, l.name), func(b *testing.B) {
			c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
			benchHandoff(b, l, n, capacity-1, c.Client(b), c.Endpoints())
		})
	}
}

// permit is one permit of a Semaphore as a benchMutex.
type permit struct{ sm *etcdsync.Semaphore }

func (p permit) Lock(ctx context.Context) error    { return p.sm.Acquire(ctx, 1) }
func (p permit) TryLock(ctx context.Context) error { return p.sm.TryAcquire(ctx, 1) }
func (p permit) Unlock(ctx context.Context) error  { return p.sm.Release(ctx) }

// BenchmarkMultiLock: the cost of holding k names at once, a MultiLock
// beside k Mutexes of one session taken one after the other (in name
// order, as deadlock-free code must).
//   - uncontended: Lock then Unlock; lock-rpcs/op and unlock-rpcs/op are
//     unary RPCs, writes/op the store's revisions.
//   - contended: two holders of the same k names alternate; handoff-p50-ms
//     is the time from one's Unlock start to the other's Lock return.
func BenchmarkMultiLock(b *testing.B) {
	for _, k := range []int{1, 2, 4, 8} {
		names := make([]string, k)
		for i := range names {
			names[i] = fmt.Sprintf("bench-multi/%d", i)
		}
		for _, kind := range []string{"multilock", "mutexes"} {
			b.Run(fmt.Sprintf("uncontended/k=%d/%s", k, kind), func(b *testing.B) {
				cli, cnt, admin := benchEtcd(b)
				ctx := context.Background()
				l := newKLock(session(b, cli), kind, names)
				var lockRPC, unlockRPC int64
				start := storeRev(b, admin)
				cnt.take()
				b.ResetTimer()
				for range b.N {
					must(b, l.Lock(ctx))
					n, _ := cnt.take()
					lockRPC += n
					must(b, l.Unlock(ctx))
					n, _ = cnt.take()
					unlockRPC += n
				}
				b.StopTimer()
				b.ReportMetric(float64(lockRPC)/float64(b.N), "lock-rpcs/op")
				b.ReportMetric(float64(unlockRPC)/float64(b.N), "unlock-rpcs/op")
				b.ReportMetric(float64(storeRev(b, admin)-start)/float64(b.N), "writes/op")
			})
			b.Run(fmt.Sprintf("contended/k=%d/%s", k, kind), func(b *testing.B) {
				c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
				cnt := counter{created: make(chan struct{}, 1024)}
				cli := c.Client(b, cnt.dial()...)
				ctx := context.Background()
				ls := []kLock{newKLock(session(b, cli), kind, names), newKLock(session(b, cli), kind, names)}
				must(b, ls[0].Lock(ctx))
				samples := make([]time.Duration, 0, b.N)
				b.ResetTimer()
				for i := range b.N {
					holder, next := ls[i%2], ls[(i+1)%2]
					got := make(chan time.Time, 1)
					var wg sync.WaitGroup
					wg.Go(func() {
						must(b, next.Lock(ctx))
						got <- time.Now()
					})
					// in its watch of the first name's prefix (the holder is all it waits for)
					<-cnt.created
					began := time.Now()
					must(b, holder.Unlock(ctx))
					wg.Wait()
					samples = append(samples, (<-got).Sub(began))
					for len(cnt.created) > 0 { // the watches of its later names
						<-cnt.created
					}
				}
				b.StopTimer()
				must(b, ls[b.N%2].Unlock(ctx))
				reportLatency(b, samples, "handoff")
			})
		}
	}
}

// kLock holds k names: a MultiLock, or Mutexes taken in order.
type kLock interface {
	Lock(context.Context) error
	Unlock(context.Context) error
}

type mutexes []*etcdsync.Mutex

func (ms mutexes) Lock(ctx context.Context) error {
	for i, m := range ms {
		if err := m.Lock(ctx); err != nil {
			for _, held := range ms[:i] {
				held.Unlock(ctx)
			}
			return err
		}
	}
	return nil
}

func (ms mutexes) Unlock(ctx context.Context) error {
	for _, m := range ms {
		if err := m.Unlock(ctx); err != nil {
			return err
		}
	}
	return nil
}

func newKLock(s *etcdsync.Session, kind string, names []string) kLock {
	if kind == "multilock" {
		return etcdsync.NewMultiLock(s, names...)
	}
	ms := make(mutexes, len(names))
	for i, name := range names {
		ms[i] = etcdsync.NewMutex(s, name)
	}
	return ms
}

// The read a waiter makes when a key it watches goes while it does not list
// all that is ahead (turn.settle): the newest keys created before its own,
// under a name with N keys, beside a read of one key. etcd serves a range
// with a sort or a create-revision bound by reading every key under the
// prefix, so its cost grows with N; one waiter makes it per release, off the
// handoff's path but on the same server.
func BenchmarkQueueRead(b *testing.B) {
	c := etcdtest.Start(b, etcdtest.Options{Fsync: *benchFsync})
	cli := c.Client(b)
	ctx := context.Background()
	for _, n := range []int{10, 100, 500, 1000} {
		prefix := fmt.Sprintf("queueread%d/", n)
		var last int64
		for i := range n {
			resp, err := cli.Put(ctx, fmt.Sprintf("%s%x", prefix, 0x7000000000000000+int64(i)*7919), "")
			must(b, err)
			last = resp.Header.Revision
		}
		b.Run(fmt.Sprintf("N=%d/list", n), func(b *testing.B) {
			for b.Loop() {
				resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(),
					clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortDescend), clientv3.WithLimit(4),
					clientv3.WithMaxCreateRev(last), clientv3.WithSerializable())
				must(b, err)
				if len(resp.Kvs) != 4 {
					b.Fatalf("listed %d keys, want 4", len(resp.Kvs))
				}
			}
		})
		b.Run(fmt.Sprintf("N=%d/one-key", n), func(b *testing.B) {
			key := fmt.Sprintf("%s%x", prefix, 0x7000000000000000)
			for b.Loop() {
				_, err := cli.Get(ctx, key, clientv3.WithSerializable())
				must(b, err)
			}
		})
	}
}

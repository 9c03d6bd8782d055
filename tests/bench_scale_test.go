package tests

// Scale benchmarks (issue 27), ours and etcd's concurrency package side by
// side, sub-benchmarks interleaved (ours, then etcd's, per size), each on a
// fresh etcd member in a child process (childEtcd), so that heap and
// goroutine figures are the clients' only. Run them once each (-fsync=true,
// the flag's default, for a production disk):
//
//	go test -run '^$' -bench 'Waiters10k|Held100k|GoroutinesBaseline' -benchtime 1x -timeout 120m . -fsync=false
//
// BenchmarkWaiters10k at N=10,000 takes about 4 minutes and 14 GB of
// memory (etcdsync's waiters keep the keys ahead of them: see BENCHMARKS.md).
//
// Counts (watch events, unary RPCs, gRPC streams opened by method, keepalive
// requests) come from interceptors on the benchmarked client and do not
// depend on machine noise; times (-s) do. BENCHMARKS.md ("Scale") has the
// figures.

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// scaleSession is one library's session, as the scale benchmarks use it.
type scaleSession interface {
	mutex(name string) benchMutex
	alive() bool
	Close() error
}

type ourSession struct{ *etcdsync.Session }

func (s ourSession) mutex(name string) benchMutex { return etcdsync.NewMutex(s.Session, name) }
func (s ourSession) alive() bool                  { return s.Err() == nil }

type etcdSess struct{ *concurrency.Session }

func (s etcdSess) mutex(name string) benchMutex { return concurrency.NewMutex(s.Session, name) }
func (s etcdSess) alive() bool {
	select {
	case <-s.Done():
		return false
	default:
		return true
	}
}

// scaleLib is a lib (its watches per waiter) and its session maker; ttl 0
// is the library's default (60 s for both).
type scaleLib struct {
	lib
	open func(cli *clientv3.Client, ttl time.Duration) (scaleSession, error)
}

var scaleLibs = []scaleLib{
	{libNamed("etcdsync"), func(cli *clientv3.Client, ttl time.Duration) (scaleSession, error) {
		var opts []etcdsync.SessionOption
		if ttl > 0 {
			opts = append(opts, etcdsync.WithTTL(ttl))
		}
		s, err := etcdsync.NewSession(cli, opts...)
		if err != nil {
			return nil, err
		}
		return ourSession{s}, nil
	}},
	{libNamed("concurrency"), func(cli *clientv3.Client, ttl time.Duration) (scaleSession, error) {
		var opts []concurrency.SessionOption
		if ttl > 0 {
			opts = append(opts, concurrency.WithTTL(int(ttl/time.Second)))
		}
		s, err := concurrency.NewSession(cli, opts...)
		if err != nil {
			return nil, err
		}
		return etcdSess{s}, nil
	}},
}

func libNamed(name string) lib {
	for _, l := range libs {
		if l.name == name {
			return l
		}
	}
	panic("no lib " + name)
}

// streamCounter counts the gRPC streams a client opens, by method, and the
// bytes of the replies to its unary RPCs (their protobuf encoding).
type streamCounter struct {
	watch      atomic.Int64 // /etcdserverpb.Watch/Watch
	keepalive  atomic.Int64 // /etcdserverpb.Lease/LeaseKeepAlive
	replyBytes atomic.Int64
}

func (c *streamCounter) dial() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			switch method {
			case "/etcdserverpb.Watch/Watch":
				c.watch.Add(1)
			case "/etcdserverpb.Lease/LeaseKeepAlive":
				c.keepalive.Add(1)
			}
			return streamer(ctx, desc, cc, method, opts...)
		}),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			err := invoker(ctx, method, req, reply, cc, opts...)
			if m, ok := reply.(proto.Message); ok && err == nil {
				c.replyBytes.Add(int64(proto.Size(m)))
			}
			return err
		}),
	}
}

// heapAndGoroutines returns the live heap after two collections (the second
// empties sync.Pool's victim caches) and the number of goroutines.
func heapAndGoroutines() (float64, int) {
	runtime.GC()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return float64(ms.HeapAlloc), runtime.NumGoroutine()
}

// forEach runs f(0..n-1) on workers goroutines and returns the first error.
func forEach(n, workers int, f func(i int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	var first atomic.Value
	for range workers {
		wg.Go(func() {
			for i := next.Add(1) - 1; i < int64(n) && first.Load() == nil; i = next.Add(1) - 1 {
				if err := f(int(i)); err != nil {
					first.CompareAndSwap(nil, err)
				}
			}
		})
	}
	wg.Wait()
	err, _ := first.Load().(error)
	return err
}

// openSessions opens n sessions on cli, 64 at a time. Those still open
// (nil'ed by closeSessions) are closed in b's cleanup.
func openSessions(b *testing.B, l scaleLib, cli *clientv3.Client, n int, ttl time.Duration) []scaleSession {
	ss := make([]scaleSession, n)
	b.Cleanup(func() {
		forEach(n, 64, func(i int) error {
			if ss[i] != nil {
				ss[i].Close()
			}
			return nil
		})
	})
	must(b, forEach(n, 64, func(i int) error {
		s, err := l.open(cli, ttl)
		ss[i] = s
		return err
	}))
	return ss
}

// closeSessions closes ss, 64 at a time, and returns how long it took.
func closeSessions(b *testing.B, ss []scaleSession) time.Duration {
	start := time.Now()
	must(b, forEach(len(ss), 64, func(i int) error {
		err := ss[i].Close()
		ss[i] = nil
		return err
	}))
	return time.Since(start)
}

// 10,000 waiters on one name (and 1,000 and 3,000, to show how the figures
// grow with N), each on a session of its own (etcd's Mutex needs one per
// waiter; two etcdsync Mutexes on one session and name would queue in the
// session, not in etcd), on one client, queued behind a holder on another
// client. Reported:
//   - sessions-s, form-s: opening the sessions (64 at a time); queue formation,
//     from the first Lock call to every waiter in its watch (each watch's
//     creation seen on the client), waiters calling Lock formBatch at a time.
//   - drain-s: from the holder's Unlock to the last waiter's Lock return,
//     each waiter unlocking as soon as it holds.
//   - events/release: watch events the waiters' client received during the
//     drain, per release (the holder's and n-1 waiters').
//   - B/waiter, goroutines/waiter: heap and goroutines, all queued, less those
//     with the sessions open and no Lock called; the caller's goroutine blocked
//     in Lock is counted (1 per waiter for both). B/session, goroutines/session:
//     the sessions open, less before they were opened.
//   - watch-streams: gRPC Watch streams opened from the first Lock to the end of
//     the drain; ka-streams: LeaseKeepAlive streams opened over the whole run.
//   - form-rpcs/waiter, drain-rpcs/waiter, rpcs/waiter: unary RPCs in the
//     formation, in the drain (each waiter's Unlock included), and both;
//     reply-B/waiter: the bytes of their replies (protobuf encoding).
//   - close-s: closing every waiter's session, 64 at a time.
func BenchmarkWaiters10k(b *testing.B) {
	for _, n := range scaleSizes([]int{100}, []int{1000, 3000, 10000}) {
		for _, l := range scaleLibs {
			b.Run(fmt.Sprintf("N=%d/%s", n, l.name), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					benchWaiters(b, l, n)
				}
			})
		}
	}
}

func benchWaiters(b *testing.B, l scaleLib, n int) {
	const name = "bench-waiters"
	eps := childEtcd(b, *benchFsync)
	admin := etcdtest.NewClient(b, eps)
	watches := queueWatches(l.lib, n)
	cnt := counter{created: make(chan struct{}, 2*watches+64)}
	var sc streamCounter
	cli := etcdtest.NewClient(b, eps, append(cnt.dial(), sc.dial()...)...)
	hs := openSessions(b, l, admin, 1, 0)
	holder := hs[0].mutex(name)
	must(b, holder.Lock(context.Background()))

	h0, g0 := heapAndGoroutines()
	start := time.Now()
	ss := openSessions(b, l, cli, n, 0)
	sessionsTime := time.Since(start)
	ms := make([]benchMutex, n)
	for i, s := range ss {
		ms[i] = s.mutex(name)
	}
	cnt.take()
	h1, g1 := heapAndGoroutines()

	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel) // runs before the sessions' cleanup: a failed run's waiters return
	var (
		wg         sync.WaitGroup
		held       atomic.Int64
		allHeld    = make(chan struct{})
		lastHeld   time.Time
		lastEvents int64
		failOnce   sync.Once
		failed     = make(chan struct{})
		failure    error
	)
	fail := func(err error) {
		failOnce.Do(func() { failure = err; close(failed) })
	}
	w0, r0 := sc.watch.Load(), sc.replyBytes.Load()
	start = time.Now()
	for i, m := range ms {
		if i%formBatch == 0 && i > 0 { // the previous batch in its watches first
			waitWatches(b, &cnt, queueWatches(l.lib, i)-queueWatches(l.lib, i-formBatch), failed, &failure)
		}
		wg.Go(func() {
			if err := m.Lock(ctx); err != nil {
				fail(err)
				return
			}
			if held.Add(1) == int64(n) {
				lastHeld, lastEvents = time.Now(), cnt.events.Load()
				close(allHeld)
			}
			if err := m.Unlock(ctx); err != nil {
				fail(err)
			}
		})
	}
	last := (n - 1) / formBatch * formBatch // the last batch's first waiter
	waitWatches(b, &cnt, watches-queueWatches(l.lib, last), failed, &failure)
	formTime := time.Since(start)
	formRPCs, _ := cnt.take()
	h2, g2 := heapAndGoroutines()
	writeProfiles(b, fmt.Sprintf("waiters-%d-%s", n, l.name))

	events := cnt.events.Load()
	start = time.Now()
	must(b, holder.Unlock(context.Background()))
	select {
	case <-allHeld:
	case <-failed:
		b.Fatalf("a waiter failed: %v", failure)
	}
	wg.Wait()
	select {
	case <-failed:
		b.Fatalf("a waiter failed: %v", failure)
	default:
	}
	drainTime := lastHeld.Sub(start)
	drainRPCs, _ := cnt.take()
	streams, replies := sc.watch.Load()-w0, sc.replyBytes.Load()-r0
	closeTime := closeSessions(b, ss)

	fn := float64(n)
	b.ReportMetric(sessionsTime.Seconds(), "sessions-s")
	b.ReportMetric(formTime.Seconds(), "form-s")
	b.ReportMetric(drainTime.Seconds(), "drain-s")
	b.ReportMetric(closeTime.Seconds(), "close-s")
	b.ReportMetric(float64(lastEvents-events)/fn, "events/release")
	b.ReportMetric((h2-h1)/fn, "B/waiter")
	b.ReportMetric(float64(g2-g1)/fn, "goroutines/waiter")
	b.ReportMetric((h1-h0)/fn, "B/session")
	b.ReportMetric(float64(g1-g0)/fn, "goroutines/session")
	b.ReportMetric(float64(streams), "watch-streams")
	b.ReportMetric(float64(streams)/fn, "watch-streams/waiter")
	b.ReportMetric(float64(sc.keepalive.Load()), "ka-streams")
	b.ReportMetric(float64(formRPCs)/fn, "form-rpcs/waiter")
	b.ReportMetric(float64(drainRPCs)/fn, "drain-rpcs/waiter")
	b.ReportMetric(float64(formRPCs+drainRPCs)/fn, "rpcs/waiter")
	b.ReportMetric(float64(replies)/fn, "reply-B/waiter")
}

// formBatch is how many waiters call Lock at once: the benchmark waits
// until they are all in their watches before the next ones call. 10,000
// Lock calls at once overload the member with either library (etcdserver:
// too many requests: its applied index 5,000 entries behind its committed
// one), and so do 1,000 at a time at N=10,000 (etcdserver: request timed
// out): every enqueue reads the whole queue on the server's apply path.
const formBatch = 100

// waitWatches waits for the creation of k watches on cnt's client, or fails
// b when a waiter failed (failed closed, *failure says why) or 10 minutes
// have passed. It is not awaitCreated: a waiter whose Lock failed creates no
// watch, and the batch's wait ends at its failure rather than at a bound;
// the bound is the whole batch's (thousands of watches under load).
func waitWatches(b *testing.B, cnt *counter, k int, failed <-chan struct{}, failure *error) {
	timeout := time.After(10 * time.Minute)
	for w := 0; w < k; w++ {
		select {
		case <-cnt.created:
		case <-failed:
			b.Fatalf("a waiter failed: %v", *failure)
		case <-timeout:
			b.Fatalf("%d of %d watches created", w, k)
		}
	}
}

// scaleProfiles, when set, is a directory where the scale benchmarks write
// heap and goroutine profiles at the point they measure them.
// scaleFull runs the scale benchmarks at their full sizes (10k waiters,
// 100k holds: minutes, and about 14 GB at 10k waiters); without -scale they
// run at a smoke size, as CI's one-iteration pass over every benchmark does.
var scaleFull = flag.Bool("scale", false, "scale benchmarks at full size (10k waiters, 100k held locks, Shards settling at 3 sizes by 2); without it, a smoke size")

// scaleSizes returns full with -scale, else smoke.
func scaleSizes[T any](smoke, full []T) []T {
	if *scaleFull {
		return full
	}
	return smoke
}

var scaleProfiles = flag.String("scaleprofiles", "", "scale benchmarks: write heap and goroutine profiles into this directory")

// writeProfiles writes the heap profile (as of the last collection) and the
// goroutine profile, named after what, into -scaleprofiles, if set.
func writeProfiles(b *testing.B, what string) {
	if *scaleProfiles == "" {
		return
	}
	for _, p := range []string{"heap", "goroutine"} {
		f, err := os.Create(filepath.Join(*scaleProfiles, what+"."+p))
		must(b, err)
		must(b, pprof.Lookup(p).WriteTo(f, 0))
		must(b, f.Close())
	}
}

// 100,000 locks held over 1,000 sessions (each session 100 locks of names of
// their own) in one process on one client, sessions with a 6 s TTL; and 10,000
// over 100. Reported:
//   - sessions-s, lock-s, close-s: opening the sessions, taking every lock,
//     closing every session (which deletes the keys), 64 at a time.
//   - B/lock, goroutines/lock: heap and goroutines with every lock held, less
//     those with the sessions open and nothing held; B/session,
//     goroutines/session: the sessions open, less before they were opened.
//   - lock-rpcs/lock: unary RPCs while locking.
//   - over a 12 s window (2 TTLs) once all are held: ka-streams/TTL, the
//     LeaseKeepAlive streams opened per TTL; ka-req/s, the keepalive requests
//     sent per second; ka-streams, those streams opened over the whole run.
//   - sessions-lost: sessions that ended before the close; keys-left: keys
//     under the names after the close.
func BenchmarkHeld100k(b *testing.B) {
	type size struct{ locks, sessions int }
	for _, sz := range scaleSizes([]size{{1000, 10}}, []size{{10000, 100}, {100000, 1000}}) {
		for _, l := range scaleLibs {
			b.Run(fmt.Sprintf("locks=%d/sessions=%d/%s", sz.locks, sz.sessions, l.name), func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					benchHeld(b, l, sz.locks, sz.sessions)
				}
			})
		}
	}
}

func benchHeld(b *testing.B, l scaleLib, locks, sessions int) {
	const (
		ttl    = 6 * time.Second
		window = 2 * ttl
	)
	eps := childEtcd(b, *benchFsync)
	admin := etcdtest.NewClient(b, eps)
	var cnt counter
	var sc streamCounter
	cli := etcdtest.NewClient(b, eps, append(cnt.dial(), sc.dial()...)...)
	names := make([]string, locks)
	for i := range names {
		names[i] = fmt.Sprintf("held/%d", i)
	}
	ms := make([]benchMutex, locks)

	h0, g0 := heapAndGoroutines()
	start := time.Now()
	ss := openSessions(b, l, cli, sessions, ttl)
	sessionsTime := time.Since(start)
	cnt.take()
	h1, g1 := heapAndGoroutines()
	start = time.Now()
	must(b, forEach(locks, 64, func(i int) error {
		ms[i] = ss[i%sessions].mutex(names[i])
		return ms[i].Lock(context.Background())
	}))
	lockTime := time.Since(start)
	lockRPCs, _ := cnt.take()
	h2, g2 := heapAndGoroutines()
	writeProfiles(b, fmt.Sprintf("held-%d-%s", locks, l.name))

	ka, streams := cnt.keepalives.Load(), sc.keepalive.Load()
	time.Sleep(window)
	ka, streams = cnt.keepalives.Load()-ka, sc.keepalive.Load()-streams
	lost := 0
	for _, s := range ss {
		if !s.alive() {
			lost++
		}
	}
	runtime.KeepAlive(ms)
	closeTime := closeSessions(b, ss)
	left, err := admin.Get(context.Background(), "held/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	must(b, err)

	b.ReportMetric(sessionsTime.Seconds(), "sessions-s")
	b.ReportMetric(lockTime.Seconds(), "lock-s")
	b.ReportMetric(closeTime.Seconds(), "close-s")
	b.ReportMetric((h2-h1)/float64(locks), "B/lock")
	b.ReportMetric(float64(g2-g1)/float64(locks), "goroutines/lock")
	b.ReportMetric((h1-h0)/float64(sessions), "B/session")
	b.ReportMetric(float64(g1-g0)/float64(sessions), "goroutines/session")
	b.ReportMetric(float64(lockRPCs)/float64(locks), "lock-rpcs/lock")
	b.ReportMetric(float64(streams)/float64(window/ttl), "ka-streams/TTL")
	b.ReportMetric(float64(ka)/window.Seconds(), "ka-req/s")
	b.ReportMetric(float64(sc.keepalive.Load()), "ka-streams")
	b.ReportMetric(float64(lost), "sessions-lost")
	b.ReportMetric(float64(left.Count), "keys-left")
}

// Goroutines before and after, on sessions that stay open: 10,000
// uncontended Lock+Unlock cycles on one session; contended cycles, two
// sessions alternating on one name (10,000 for etcdsync; 1,000 for etcd's
// client, whose waiter watches from a revision the server has reached and
// so waits for its 100 ms resync at each handoff); 1,000 waits cancelled
// once in their watch, behind a holder on another client. The baseline is
// taken after one warm-up of the same kind (what a client starts once is
// not counted), the count after at most 5 s for goroutines to wind down.
// goroutines-delta is the difference (goal 0); the groups of stacks that
// grew are logged. close-delta: after closing the sessions, against the
// client alone.
func BenchmarkGoroutinesBaseline(b *testing.B) {
	cases := []struct {
		name   string
		cycles map[string]int
	}{
		{"uncontended", map[string]int{"etcdsync": 10000, "concurrency": 10000}},
		{"contended", map[string]int{"etcdsync": 10000, "concurrency": 1000}},
		{"cancelled", map[string]int{"etcdsync": 1000, "concurrency": 1000}},
	}
	if !*scaleFull {
		for _, c := range cases {
			for lib := range c.cycles {
				c.cycles[lib] = 100
			}
		}
	}
	for _, c := range cases {
		for _, l := range scaleLibs {
			b.Run(c.name+"/"+l.name, func(b *testing.B) {
				for i := 0; i < b.N; i++ {
					benchBaseline(b, l, c.name, c.cycles[l.name])
				}
			})
		}
	}
}

func benchBaseline(b *testing.B, l scaleLib, kind string, cycles int) {
	const name = "bench-baseline"
	eps := childEtcd(b, *benchFsync)
	admin := etcdtest.NewClient(b, eps)
	var cnt counter
	if kind == "cancelled" {
		cnt.created = make(chan struct{}, 16)
	}
	cli := etcdtest.NewClient(b, eps, cnt.dial()...)
	ctx := context.Background()
	for _, c := range []*clientv3.Client{admin, cli} { // connected
		_, err := c.Get(ctx, "\x00")
		must(b, err)
	}
	time.Sleep(time.Second)
	gClient, atClient := runtime.NumGoroutine(), goroutineGroups()
	ss := openSessions(b, l, cli, 2, 0)
	a, other := ss[0].mutex(name), ss[1].mutex(name)
	var hs []scaleSession
	if kind == "cancelled" { // a holder, on another client
		hs = openSessions(b, l, admin, 1, 0)
		must(b, hs[0].mutex(name).Lock(ctx))
	}
	var run func(n int) error
	switch kind {
	case "uncontended":
		run = func(n int) error {
			for range n {
				if err := a.Lock(ctx); err != nil {
					return err
				}
				if err := a.Unlock(ctx); err != nil {
					return err
				}
			}
			return nil
		}
	case "contended":
		run = func(n int) error {
			left := int64(n)
			var failure atomic.Value
			var wg sync.WaitGroup
			for _, m := range []benchMutex{a, other} {
				wg.Go(func() {
					for atomic.AddInt64(&left, -1) >= 0 {
						err := m.Lock(ctx)
						if err == nil {
							err = m.Unlock(ctx)
						}
						if err != nil {
							failure.CompareAndSwap(nil, err)
							return
						}
					}
				})
			}
			wg.Wait()
			err, _ := failure.Load().(error)
			return err
		}
	case "cancelled":
		run = func(n int) error {
			for range n {
				wctx, cancel := context.WithCancel(ctx)
				got := make(chan error, 1)
				go func() { got <- a.Lock(wctx) }()
				for range l.watches(1) { // in its watch
					<-cnt.created
				}
				cancel()
				if err := <-got; err == nil {
					return fmt.Errorf("a cancelled wait took the lock")
				}
			}
			return nil
		}
	}
	must(b, run(1))             // warm-up
	time.Sleep(2 * time.Second) // past a cancelled acquire's createGrace timer
	g0 := runtime.NumGoroutine()
	before := goroutineGroups()
	b.ResetTimer()
	must(b, run(cycles))
	b.StopTimer()
	g1 := settleGoroutines(g0, 5*time.Second)
	if g1 != g0 {
		logChange(b, "after the cycles", before, goroutineGroups())
	}
	closeSessions(b, ss)
	closeSessions(b, hs)
	g2 := settleGoroutines(gClient, 5*time.Second)
	if g2 != gClient {
		logChange(b, "after Close, against the client alone", atClient, goroutineGroups())
	}
	b.ReportMetric(float64(cycles), "cycles")
	b.ReportMetric(float64(g0), "goroutines-before")
	b.ReportMetric(float64(g1-g0), "goroutines-delta")
	b.ReportMetric(float64(g2-gClient), "close-delta")
}

// settleGoroutines waits at most d for the goroutines to come down to want,
// and returns their number.
func settleGoroutines(want int, d time.Duration) int {
	for end := time.Now().Add(d); ; time.Sleep(20 * time.Millisecond) {
		if g := runtime.NumGoroutine(); g <= want || time.Now().After(end) {
			return g
		}
	}
}

// goroutineGroups returns this process's goroutines grouped by stack (from
// pprof's goroutine profile), each stack named by its functions, innermost
// first.
func goroutineGroups() map[string]int {
	var buf bytes.Buffer
	pprof.Lookup("goroutine").WriteTo(&buf, 1)
	groups := make(map[string]int)
	n, frames := 0, []string(nil)
	flush := func() {
		if n > 0 {
			groups[strings.Join(frames, " < ")] += n
		}
		n, frames = 0, nil
	}
	for line := range strings.SplitSeq(buf.String(), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[0] == "#" && strings.HasPrefix(f[1], "0x"):
			fn, _, _ := strings.Cut(f[2], "+0x")
			frames = append(frames, fn)
		case len(f) >= 2 && f[1] == "@":
			flush()
			fmt.Sscanf(f[0], "%d", &n)
		}
	}
	flush()
	return groups
}

// logChange logs the stack groups whose goroutines grew or shrank from
// before to after, most first, without the runtime's own frames.
func logChange(b *testing.B, when string, before, after map[string]int) {
	type change struct {
		stack string
		by    int
	}
	var cs []change
	for stack := range maps.Keys(before) {
		if _, ok := after[stack]; !ok {
			after[stack] = 0
		}
	}
	for stack, n := range after {
		if d := n - before[stack]; d != 0 {
			var fns []string
			for fn := range strings.SplitSeq(stack, " < ") {
				if !strings.HasPrefix(fn, "runtime.") {
					fns = append(fns, fn)
				}
			}
			if len(fns) == 0 {
				fns = strings.Split(stack, " < ")
			}
			cs = append(cs, change{strings.Join(fns[:min(len(fns), 6)], " < "), d})
		}
	}
	slices.SortFunc(cs, func(x, y change) int { return y.by - x.by })
	for _, c := range cs {
		b.Logf("%s: %+d goroutines: %s", when, c.by, c.stack)
	}
}

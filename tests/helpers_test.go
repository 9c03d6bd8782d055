package tests

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// testTimeout bounds every wait in a test (and in the fault kit).
const testTimeout = faults.Timeout

// Tests run 16 at a time (8 with -race) unless -parallel says otherwise (see
// etcdtest.DefaultParallel). The goroutines embedded members leave for the
// life of the process are not leaks.
func TestMain(m *testing.M) { etcdtest.Main(m, etcdsynctest.IgnoredGoroutines()...) }

// long skips t unless the long runs are on (go test -tags long).
func long(t *testing.T) {
	t.Helper()
	if !longRuns {
		t.Skip("a long run: go test -tags long")
	}
}

func single(t *testing.T) *etcdtest.Cluster {
	return etcdtest.Start(t, etcdtest.Options{})
}

func three(t *testing.T) *etcdtest.Cluster {
	etcdtest.SkipClusterInShort(t, 3)
	return etcdtest.Start(t, etcdtest.Options{Members: 3})
}

// singleClient is single with a client of the member and a test context:
// what most tests start with.
func singleClient(t *testing.T) (*etcdtest.Cluster, *clientv3.Client, context.Context) {
	c := single(t)
	return c, c.Client(t), ctxT(t)
}

// clusters runs f on a single member and on a 3-member cluster.
func clusters(t *testing.T, f func(t *testing.T, c *etcdtest.Cluster)) {
	t.Run("single", func(t *testing.T) { f(t, single(t)) })
	t.Run("three", func(t *testing.T) { f(t, three(t)) })
}

// kitSingle, kitThree and kitClusters are single, three and clusters on the
// public test kit, etcdsynctest, for the tests that need nothing more than it
// offers (clients, member stop/restart, a client link to cut): the kit is
// exercised by every run of them. Fault tests that need peer proxies, TLS or
// dropped connections stay on the internal rig.
func kitSingle(t *testing.T) *etcdsynctest.Cluster {
	return etcdsynctest.StartCluster(t, 1)
}

func kitThree(t *testing.T) *etcdsynctest.Cluster {
	etcdtest.SkipClusterInShort(t, 3)
	return etcdsynctest.StartCluster(t, 3)
}

// kitSingleClient is singleClient on the public test kit.
func kitSingleClient(t *testing.T) (*etcdsynctest.Cluster, *clientv3.Client, context.Context) {
	c := kitSingle(t)
	return c, c.Client(t), ctxT(t)
}

func kitClusters(t *testing.T, f func(t *testing.T, c *etcdsynctest.Cluster)) {
	t.Run("single", func(t *testing.T) { f(t, kitSingle(t)) })
	t.Run("three", func(t *testing.T) { f(t, kitThree(t)) })
}

// kitClient returns a client of every member of c with extra dial options
// (a counter's interceptors), closed in t's cleanup.
func kitClient(t *testing.T, c *etcdsynctest.Cluster, dial ...grpc.DialOption) *clientv3.Client {
	t.Helper()
	return etcdtest.NewClient(t, c.Endpoints(), dial...)
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// session returns a session of ours on cli, closed in t's cleanup (a test's
// or a benchmark's).
func session(t testing.TB, cli *clientv3.Client, opts ...etcdsync.SessionOption) *etcdsync.Session {
	t.Helper()
	s, err := etcdsync.NewSession(cli, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// theirSession returns a session of etcd's own concurrency package on cli,
// closed in t's cleanup (a test's or a benchmark's).
func theirSession(t testing.TB, cli *clientv3.Client, opts ...concurrency.SessionOption) *concurrency.Session {
	t.Helper()
	s, err := concurrency.NewSession(cli, opts...)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return s
}

// heldMutex returns a Mutex on name of a new session of cli, holding.
func heldMutex(t *testing.T, ctx context.Context, cli *clientv3.Client, name string) *etcdsync.Mutex {
	t.Helper()
	m := etcdsync.NewMutex(session(t, cli), name)
	require.NoError(t, m.Lock(ctx))
	return m
}

// keys returns the keys under prefix.
func keys(t *testing.T, cli *clientv3.Client, prefix string) []string {
	t.Helper()
	resp, err := cli.Get(ctxT(t), prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly())
	require.NoError(t, err)
	var out []string
	for _, kv := range resp.Kvs {
		out = append(out, string(kv.Key))
	}
	return out
}

// within fails t unless ch closes within d.
func within(t *testing.T, ch <-chan struct{}, d time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(d):
		t.Fatalf("%s: not within %v", what, d)
	}
}

// notWithin fails t if ch closes within d (for "must still block" checks).
func notWithin(t *testing.T, ch <-chan struct{}, d time.Duration, what string) {
	t.Helper()
	select {
	case <-ch:
		t.Fatalf("%s: happened, must not", what)
	case <-time.After(d):
	}
}

// counter counts the unary RPCs, streams and watch events of one client.
type counter struct {
	unary, streams, events atomic.Int64
	watchStreams           atomic.Int64  // gRPC Watch streams opened
	keepalives             atomic.Int64  // LeaseKeepAlive requests sent
	lastEvents             atomic.Int64  // when the last watch response with events came off the wire (UnixNano)
	created                chan struct{} // one send per watch created, if non-nil and not full
	returned               chan struct{} // one send per unary RPC returned, if non-nil
	// ownApart leaves out of events those that reach the first watch of
	// their key: a wait's own key, which it watches before anyone behind
	// it does (a delete of it that reaches its former waiter, whose
	// watch's cancel the release overtook, is not a release reaching a
	// waiter).
	ownApart bool
	watched  sync.Map // key -> true once a watch of it was created
	mu       sync.Mutex
	methods  []string
}

func (c *counter) dial() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			c.unary.Add(1)
			c.mu.Lock()
			c.methods = append(c.methods, method)
			c.mu.Unlock()
			err := invoker(ctx, method, req, reply, cc, opts...)
			if c.returned != nil {
				c.returned <- struct{}{}
			}
			return err
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			c.streams.Add(1)
			if method == "/etcdserverpb.Watch/Watch" {
				c.watchStreams.Add(1)
			}
			s, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return nil, err
			}
			return &countingStream{ClientStream: s, c: c}, nil
		}),
	}
}

// rpcs returns the unary RPC count and the methods called, and resets both.
func (c *counter) take() (int64, []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, m := c.unary.Swap(0), c.methods
	c.methods = nil
	return n, m
}

type countingStream struct {
	grpc.ClientStream
	c  *counter
	mu sync.Mutex
	// creating is the keys of the watches asked for and not yet created,
	// in order (the client's Watcher creates one at a time per stream);
	// firsts, the IDs of the watches that were their key's first.
	creating []string
	firsts   map[int64]bool
}

func (s *countingStream) SendMsg(m any) error {
	switch m := m.(type) {
	case *pb.LeaseKeepAliveRequest:
		s.c.keepalives.Add(1)
	case *pb.WatchRequest:
		if cr := m.GetCreateRequest(); cr != nil {
			s.mu.Lock()
			s.creating = append(s.creating, string(cr.Key))
			s.mu.Unlock()
		}
	}
	return s.ClientStream.SendMsg(m)
}

func (s *countingStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	wr, ok := m.(*pb.WatchResponse)
	if !ok || err != nil {
		return err
	}
	s.mu.Lock()
	if wr.Created && len(s.creating) > 0 {
		key := s.creating[0]
		s.creating = s.creating[1:]
		if _, seen := s.c.watched.LoadOrStore(key, true); !seen {
			if s.firsts == nil {
				s.firsts = map[int64]bool{}
			}
			s.firsts[wr.WatchId] = true
		}
	}
	first := s.firsts[wr.WatchId]
	s.mu.Unlock()
	if !s.c.ownApart || !first {
		s.c.events.Add(int64(len(wr.Events)))
	}
	if len(wr.Events) > 0 {
		s.c.lastEvents.Store(time.Now().UnixNano())
	}
	if wr.Created && s.c.created != nil {
		select { // never stall the client's receive on a full count
		case s.c.created <- struct{}{}:
		default:
		}
	}
	return err
}

// async runs f in a goroutine and returns a channel that gets its error.
func async(f func() error) <-chan error {
	ch := make(chan error, 1)
	go func() { ch <- f() }()
	return ch
}

// doneAsync runs f in a goroutine and returns a channel closed when f has
// returned; an error of f (what f is) is reported on t.
func doneAsync(t *testing.T, what string, f func() error) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := f(); err != nil {
			t.Errorf("%s: %v", what, err)
		}
	}()
	return done
}

// resultWithin waits at most d for a result on ch.
func resultWithin(t *testing.T, ch <-chan error, d time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		t.Fatalf("%s: no result within %v", what, d)
		return nil
	}
}

// notYet fails if ch yields within d.
func notYet(t *testing.T, ch <-chan error, d time.Duration, what string) {
	t.Helper()
	select {
	case err := <-ch:
		t.Fatalf("%s: returned (%v), must still wait", what, err)
	case <-time.After(d):
	}
}

// keyOf is the key of session s on name: name, "/" and s's lease in hex.
// keyOf("", s), "/" and the lease in hex, is how every key of s ends.
func keyOf(name string, s *etcdsync.Session) string {
	return fmt.Sprintf("%s/%x", name, int64(s.Lease()))
}

// isHexChild reports whether key is prefix followed by lowercase hex digits
// alone: a key NAME/<lease hex> of a session directly under prefix NAME/.
func isHexChild(prefix, key string) bool {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok || rest == "" {
		return false
	}
	for _, c := range rest {
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// storeRev returns the store's revision, read within testTimeout: the writes
// between two reads are its difference.
func storeRev(t testing.TB, cli *clientv3.Client) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := cli.Get(ctx, "\x00")
	require.NoError(t, err)
	return resp.Header.Revision
}

// cancelsLeaveOnly makes n acquires, the i-th under a context that ends
// (i mod spread) × 250 µs after it starts (before, during or after its
// create): each must fail, and leave under prefix the key want alone.
func cancelsLeaveOnly(t *testing.T, ctx context.Context, cli *clientv3.Client, prefix, want string, n, spread int, acquire func(ctx context.Context, i int) error) {
	t.Helper()
	for i := 0; i < n; i++ {
		rctx, cancel := context.WithTimeout(ctx, time.Duration(i%spread)*250*time.Microsecond)
		err := acquire(rctx, i)
		cancel()
		require.Error(t, err, "trial %d", i)
		require.Equal(t, []string{want}, keys(t, cli, prefix), "trial %d", i)
	}
}

// waiterLosesOwnKey starts acquire, a waiter behind the hold whose key is
// held, waits until its own key is queued under prefix, deletes that key,
// and requires acquire to return ErrSessionExpired at once (within 5 s).
func waiterLosesOwnKey(t *testing.T, ctx context.Context, cli *clientv3.Client, prefix, held string, acquire func() error, what string) {
	t.Helper()
	got := async(acquire)
	waitKeys(t, cli, prefix, 2)
	var own []string
	for _, k := range keys(t, cli, prefix) {
		if k != held {
			own = append(own, k)
		}
	}
	require.Len(t, own, 1)
	_, err := cli.Delete(ctx, own[0])
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, got, 5*time.Second, what+" whose key was deleted"), etcdsync.ErrSessionExpired)
}

// awaitDelete reads wch, a watch opened before, until it delivers a delete,
// and returns when it did (the time a latency is measured to). wch's context
// bounds it: t fails when the watch ends first.
func awaitDelete(t *testing.T, wch clientv3.WatchChan) time.Time {
	t.Helper()
	for {
		wr, ok := <-wch
		require.True(t, ok, "admin watch ended")
		for _, ev := range wr.Events {
			if ev.Type == clientv3.EventTypeDelete {
				return time.Now()
			}
		}
	}
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// awaitCreated waits for n watch creations signalled on created, one send
// each (a counter's, a Watcher's, faults.LateClient's watch IDs), at most d
// for each; t fails (what, and how many came) when one does not come.
func awaitCreated[T any](t *testing.T, created <-chan T, n int, d time.Duration, what string) {
	t.Helper()
	for i := range n {
		select {
		case <-created:
		case <-time.After(d):
			t.Fatalf("%s: %d of %d watches created, the next not within %v", what, i, n, d)
		}
	}
}

// waitKeys waits, at most testTimeout, until prefix has n keys or more
// (watching, not polling).
func waitKeys(t testing.TB, cli *clientv3.Client, prefix string, n int) {
	t.Helper()
	waitCount(t, cli, prefix, testTimeout, func(have int) bool { return have >= n })
}

// waitNoKeys waits, at most testTimeout, until nothing is under prefix
// (watching, not polling).
func waitNoKeys(t testing.TB, cli *clientv3.Client, prefix string) {
	t.Helper()
	waitCount(t, cli, prefix, testTimeout, func(have int) bool { return have == 0 })
}

// waitCount waits, at most d, until the number of keys under prefix
// satisfies done: it reads the count, then watches the prefix from there
// (the one implementation of waitKeys and waitNoKeys). t fails when d
// passes (or the watch ends) first.
func waitCount(t testing.TB, cli *clientv3.Client, prefix string, d time.Duration, done func(have int) bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	have := int(resp.Count)
	wch := cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(resp.Header.Revision+1))
	for !done(have) {
		wr, ok := <-wch
		require.True(t, ok, "waiting for the keys under %s, have %d after %v", prefix, have, d)
		for _, ev := range wr.Events {
			if ev.IsCreate() {
				have++
			} else if ev.Type == clientv3.EventTypeDelete {
				have--
			}
		}
	}
}

// waits is how many watches a waiter with listed keys ahead of it that
// block it (one permit each) creates, under a rule that lets run-1 of them
// remain when it holds (a Mutex: run 1): one of the whole prefix at the
// front of its queue (listed <= run+1: two behind the keys that may hold),
// else one of its own key and one of each key of the run it watches.
func waits(listed, run int) int {
	if listed <= run+1 {
		return 1
	}
	return 1 + run
}

// contendMutexes has each mutex Lock, hold for a moment, Unlock, rounds
// times, concurrently; it fails t when two hold at once or a Lock returns
// nil with its key gone.
func contendMutexes(t *testing.T, ctx context.Context, check *clientv3.Client, ms []*etcdsync.Mutex, rounds int) {
	t.Helper()
	var in atomic.Int32
	var wg sync.WaitGroup
	for i, m := range ms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				if err := m.Lock(ctx); err != nil {
					t.Errorf("mutex %d round %d: Lock: %v", i, r, err)
					return
				}
				if n := in.Add(1); n != 1 {
					t.Errorf("mutex %d round %d: %d holders at once", i, r, n)
				}
				if check != nil {
					resp, err := check.Get(ctx, m.Key())
					if err != nil || len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != m.Rev() {
						t.Errorf("mutex %d round %d: Lock returned nil with key %s (rev %d) gone (%v)", i, r, m.Key(), m.Rev(), err)
					}
				}
				time.Sleep(time.Millisecond)
				in.Add(-1)
				if err := m.Unlock(ctx); err != nil {
					t.Errorf("mutex %d round %d: Unlock: %v", i, r, err)
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	within(t, done, testTimeout, "contending mutexes")
}

// nthKey returns the key under prefix with the i-th lowest create revision.
func nthKey(t *testing.T, ctx context.Context, cli *clientv3.Client, prefix string, i int) string {
	t.Helper()
	resp, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	require.NoError(t, err)
	require.Greater(t, len(resp.Kvs), i)
	return string(resp.Kvs[i].Key)
}

func chanOf(ch chan int64) <-chan struct{} {
	out := make(chan struct{})
	go func() { <-ch; close(out) }()
	return out
}

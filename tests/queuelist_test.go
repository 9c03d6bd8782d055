package tests

// What a contender lists of the queue: under a Mutex or an Election only the
// newest keys up to its own (a reply that does not grow with the queue), and
// every key when those do not settle who blocks it (keys of nested names, a
// key of its own that existed before newer ones).

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/grpc"
)

// listed counts the keys the unary replies of a client list (ranges, also
// inside transactions).
type listed struct {
	mu  sync.Mutex
	max int // the most keys one reply listed
}

func (l *listed) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		n := 0
		switch r := reply.(type) {
		case *pb.RangeResponse:
			n = len(r.Kvs)
		case *pb.TxnResponse:
			for _, op := range r.Responses {
				n += len(op.GetResponseRange().GetKvs())
			}
		}
		l.mu.Lock()
		l.max = max(l.max, n)
		l.mu.Unlock()
		return err
	})
}

func (l *listed) take() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.max
	l.max = 0
	return n
}

// A Mutex waiter behind 30 others lists at most the four newest keys up to
// its own (and its own key) in any reply, and still takes its turn in order.
func TestWaitersListOnlyTheNewestKeys(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var l listed
	cli := c.Client(t, l.dial())
	const n = 30
	ms := make([]*etcdsync.Mutex, n)
	for i := range ms {
		ms[i] = etcdsync.NewMutex(session(t, admin), "newest")
	}
	require.NoError(t, ms[0].Lock(ctx))
	waits := make([]<-chan error, n)
	for i := 1; i < n; i++ {
		waits[i] = async(func() error { return ms[i].Lock(ctx) })
		waitKeys(t, admin, "newest/", i+1)
	}
	last := etcdsync.NewMutex(session(t, cli), "newest")
	l.take()
	lastHolds := async(func() error { return last.Lock(ctx) })
	waitKeys(t, admin, "newest/", n+1)
	for i := 0; i < n; i++ {
		notYet(t, lastHolds, 0, "the last waiter holds before the ones ahead")
		require.NoError(t, ms[i].Unlock(ctx))
		if i+1 < n {
			require.NoError(t, resultWithin(t, waits[i+1], testTimeout, fmt.Sprintf("waiter %d holds", i+1)))
		}
	}
	require.NoError(t, resultWithin(t, lastHolds, testTimeout, "the last waiter holds"))
	require.LessOrEqual(t, l.take(), 5, "keys listed in one reply")
	require.NoError(t, last.Unlock(ctx))
}

// Keys of nested names newer than the holder's fill a limited list: a
// contender then lists every key, and still waits for the holder (Lock,
// Campaign) or is refused (TryLock, TryCampaign).
func TestNestedKeysNeverHideTheHolder(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	for _, kind := range []string{"mutex", "election"} {
		t.Run(kind, func(t *testing.T) {
			name := "hidden-" + kind
			holder := etcdsync.NewMutex(session(t, cli), name)
			require.NoError(t, holder.Lock(ctx))
			for i := range 6 {
				_, err := cli.Put(ctx, fmt.Sprintf("%s/x/%d", name, i), "nested")
				require.NoError(t, err)
			}
			s := session(t, cli)
			var take, try func(context.Context) error
			if kind == "mutex" {
				m := etcdsync.NewMutex(s, name)
				take, try = m.Lock, m.TryLock
			} else {
				e := etcdsync.NewElection(s, name)
				take = func(ctx context.Context) error { return e.Campaign(ctx, "v") }
				try = func(ctx context.Context) error { return e.TryCampaign(ctx, "v") }
			}
			require.ErrorIs(t, try(ctx), etcdsync.ErrLocked)
			require.Equal(t, []string{holder.Key()}, directChildren(t, cli, name))
			got := async(func() error { return take(ctx) })
			notYet(t, got, 200*time.Millisecond, "took the name while the holder holds")
			require.NoError(t, holder.Unlock(ctx))
			require.NoError(t, resultWithin(t, got, testTimeout, "took the name once the holder let go"))
		})
	}
}

// directChildren returns the keys directly under name (NAME/x, whatever x
// is, but no deeper key): all must be checked, not only NAME/<hex>.
func directChildren(t *testing.T, cli *clientv3.Client, name string) []string {
	t.Helper()
	var out []string
	for _, k := range keys(t, cli, name+"/") {
		if rest := strings.TrimPrefix(k, name+"/"); !strings.Contains(rest, "/") {
			out = append(out, k)
		}
	}
	return out
}

// countedMutex returns a Mutex on name of a session on a client of c's first
// member whose unary RPCs and watch creations are counted.
func countedMutex(t *testing.T, c *etcdtest.Cluster, name string) (*etcdsync.Mutex, *counter) {
	cnt := &counter{created: make(chan struct{}, 64)}
	s := session(t, etcdtest.NewClient(t, []string{c.Members()[0].Endpoint()}, cnt.dial()...))
	return etcdsync.NewMutex(s, name), cnt
}

// Keys of nested names (a lock on NAME/x, seed 002) between a waiter and
// its predecessor must not put a read on the handoff's critical path: the
// design fixes 0 RPCs after the predecessor's delete arrives, at any queue
// length. Here the waiter's limited list sees only its predecessor among
// the three keys before its own (the others are nested keys), and an
// older holder beyond the list.
func TestNestedKeysAddNoRPCOnTheCriticalPath(t *testing.T) {
	t.Parallel()
	for _, nested := range []int{2, 5} {
		t.Run(fmt.Sprintf("nested=%d", nested), func(t *testing.T) {
			c := single(t)
			admin := c.Client(t)
			ctx := ctxT(t)
			name := fmt.Sprintf("critnest%d", nested)
			holder := heldMutex(t, ctx, admin, name)
			for i := range nested { // between the holder and the predecessor
				_, err := admin.Put(ctx, fmt.Sprintf("%s/old/%d", name, i), "nested")
				require.NoError(t, err)
			}
			pred := etcdsync.NewMutex(session(t, admin), name)
			predHolds := async(func() error { return pred.Lock(ctx) })
			waitKeys(t, admin, name+"/", 2+nested)
			for i := range 2 { // between the predecessor and the waiter
				_, err := admin.Put(ctx, fmt.Sprintf("%s/new/%d", name, i), "nested")
				require.NoError(t, err)
			}
			m, cnt := countedMutex(t, c, name)
			holds := async(func() error { return m.Lock(ctx) })
			within(t, cnt.created, testTimeout, "the waiter's watch of the prefix") // the holder and its predecessor are all it waits for
			require.NoError(t, holder.Unlock(ctx))
			require.NoError(t, resultWithin(t, predHolds, testTimeout, "the predecessor holds"))
			notYet(t, holds, 300*time.Millisecond, "the waiter holds with its predecessor holding")
			turnWithNoRPC(t, cnt, func() error { return pred.Unlock(ctx) }, holds, "the waiter after its predecessor's Unlock")
			require.NoError(t, m.Unlock(ctx))
		})
	}
}

// Keys of nested names older than the holder's: the second waiter's
// limited list shows the holder, its predecessor and a nested key, with an
// older key beyond it (it may not be at the front). It must still learn
// where it stands before its predecessor releases (when the holder goes, at
// the latest), so that the predecessor's release hands it the turn with no
// RPC. It used to watch only its predecessor, and read on its delete.
func TestNestedKeysOlderThanTheHolderAddNoRPCOnTheCriticalPath(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const name = "critolder"
	for i := range 2 { // before the holder: the limited list ends on one, the other beyond it
		_, err := admin.Put(ctx, fmt.Sprintf("%s/old/%d", name, i), "nested")
		require.NoError(t, err)
	}
	holder := heldMutex(t, ctx, admin, name)
	pred := etcdsync.NewMutex(session(t, admin), name)
	predHolds := async(func() error { return pred.Lock(ctx) })
	waitKeys(t, admin, name+"/", 4)
	m, cnt := countedMutex(t, c, name)
	holds := async(func() error { return m.Lock(ctx) })
	within(t, cnt.created, testTimeout, "the waiter's watch of the prefix (its short list fell short: it listed all)")
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, predHolds, testTimeout, "the predecessor holds"))
	notYet(t, holds, 300*time.Millisecond, "the waiter holds with its predecessor holding")
	turnWithNoRPC(t, cnt, func() error { return pred.Unlock(ctx) }, holds, "the waiter after its predecessor's Unlock")
	require.NoError(t, m.Unlock(ctx))
}

// A restarted process's key (WithLease) that still waits, with more than
// listLimit newer waiters and nested keys behind it and the holder ahead:
// the resumed Lock waits for the holder, then holds at the key's revision
// before every newer waiter; a resumed hold with as many newer keys behind
// it holds at once.
func TestResumedWaitingKeyBehindManyNewerKeys(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	const name = "resumewait"
	holder := heldMutex(t, ctx, admin, name)
	lease, err := admin.Grant(ctx, 30)
	require.NoError(t, err)
	own := fmt.Sprintf("%s/%x", name, int64(lease.ID))
	put, err := admin.Put(ctx, own, "", clientv3.WithLease(lease.ID))
	require.NoError(t, err)
	rev := put.Header.Revision
	const n = 6
	ws := make([]*etcdsync.Mutex, n)
	got := make([]<-chan error, n)
	for i := range ws {
		_, err := admin.Put(ctx, fmt.Sprintf("%s/x/%d", name, i), "nested")
		require.NoError(t, err)
		ws[i] = etcdsync.NewMutex(session(t, admin), name)
		got[i] = async(func() error { return ws[i].Lock(ctx) })
		waitKeys(t, admin, name+"/", 2+2*(i+1))
	}
	m := etcdsync.NewMutex(session(t, admin, etcdsync.WithLease(lease.ID)), name)
	resumed := async(func() error { return m.Lock(ctx) })
	notYet(t, resumed, 300*time.Millisecond, "the resumed waiting key holds while the holder holds")
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, resumed, testTimeout, "the resumed key holds"))
	require.Equal(t, rev, m.Rev())
	for i := range ws {
		notYet(t, got[i], 0, fmt.Sprintf("waiter %d holds with the resumed key holding", i))
	}
	notYet(t, got[0], 200*time.Millisecond, "waiter 0 holds with the resumed key holding")
	require.NoError(t, m.Unlock(ctx))
	for i := range ws {
		require.NoError(t, resultWithin(t, got[i], testTimeout, fmt.Sprintf("waiter %d holds", i)))
		for j := i + 1; j < n; j++ {
			notYet(t, got[j], 0, fmt.Sprintf("waiter %d holds before waiter %d", j, i))
		}
		require.NoError(t, ws[i].Unlock(ctx))
	}
}

// TryLock and TryCampaign on a name whose holder is older than listLimit
// newer keys of every kind that does not block (nested names, direct
// children that are not hex, etcd's own concurrency keys of a nested name)
// get ErrLocked naming a key that exists, write nothing that stays; once
// the holder goes they succeed.
func TestTryBehindNonBlockingKeysOfEveryKind(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	for _, kind := range []string{"mutex", "election"} {
		t.Run(kind, func(t *testing.T) {
			name := "trynb-" + kind
			holder := etcdsync.NewMutex(session(t, cli), name)
			require.NoError(t, holder.Lock(ctx))
			for i := range 3 {
				_, err := cli.Put(ctx, fmt.Sprintf("%s/zz%d", name, i), "not hex")
				require.NoError(t, err)
			}
			theirs := concurrency.NewMutex(theirSession(t, cli), name+"/sub")
			require.NoError(t, theirs.Lock(ctx))
			_, err := cli.Put(ctx, name+"/", "empty rest")
			require.NoError(t, err)
			_, err = cli.Put(ctx, name+"/ABC", "upper-case hex")
			require.NoError(t, err)
			before := keys(t, cli, name+"/")
			s := session(t, cli)
			var try func(context.Context) error
			if kind == "mutex" {
				try = etcdsync.NewMutex(s, name).TryLock
			} else {
				e := etcdsync.NewElection(s, name)
				try = func(ctx context.Context) error { return e.TryCampaign(ctx, "v") }
			}
			err = try(ctx)
			require.ErrorIs(t, err, etcdsync.ErrLocked)
			require.Contains(t, err.Error(), holder.Key(), "ErrLocked names a key that blocks")
			require.Equal(t, before, keys(t, cli, name+"/"))
			require.NoError(t, holder.Unlock(ctx))
			require.NoError(t, try(ctx), "the name is free but for keys that do not block")
		})
	}
}

// TryLock and TryCampaign on a held name write nothing, also when keys of a
// nested name (a lock on NAME/x, seed 002) are newer than the holder's: the
// limited list then shows nothing that blocks, and one read of every key
// finds the holder (2 RPCs; 1 when the newest keys include a blocking one).
func TestTryOnAHeldNameBehindNestedKeysWritesNothing(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	for _, kind := range []string{"mutex", "election"} {
		t.Run(kind, func(t *testing.T) {
			name := "try1rpc-" + kind
			holder := heldMutex(t, ctx, admin, name)
			for i := range listLimitForTests {
				heldMutex(t, ctx, admin, fmt.Sprintf("%s/x%d", name, i))
			}
			cnt := &counter{}
			cli := etcdtest.NewClient(t, []string{c.Members()[0].Endpoint()}, cnt.dial()...)
			s := session(t, cli)
			var try func(context.Context) error
			if kind == "mutex" {
				try = etcdsync.NewMutex(s, name).TryLock
			} else {
				e := etcdsync.NewElection(s, name)
				try = func(ctx context.Context) error { return e.TryCampaign(ctx, "v") }
			}
			rev := func() int64 {
				r, err := admin.Get(ctx, "any")
				require.NoError(t, err)
				return r.Header.Revision
			}
			cnt.take()
			r0 := rev()
			require.ErrorIs(t, try(ctx), etcdsync.ErrLocked)
			n, methods := cnt.take()
			require.Equal(t, []string{"/etcdserverpb.KV/Txn", "/etcdserverpb.KV/Range"}, methods, "RPCs of a TryLock on a held name behind nested keys (%d)", n)
			require.Equal(t, r0, rev(), "a TryLock on a held name wrote")
			require.NoError(t, holder.Unlock(ctx))
		})
	}
}

// listLimitForTests is the library's listLimit (internal/queue/slot.go).
const listLimitForTests = 4

// Waiters with keys of nested names and non-hex children between them at
// every position, and waiters giving up at every position (the nearest keys
// go in every order, the 3rd and 4th newest included): at most one holds at
// a time, the ones that stay hold in create order, nothing is left behind.
func TestInterleavedNestedKeysAndCancelsKeepExclusionAndOrder(t *testing.T) {
	t.Parallel()
	_, admin, _ := singleClient(t)
	for trial, pattern := range []struct{ nested, cancel []int }{
		{nested: []int{0, 1, 2, 3, 0, 2, 1, 3}, cancel: []int{2, 3}},
		{nested: []int{3, 0, 0, 3, 0, 0, 3, 0}, cancel: []int{1, 4, 5}},
		{nested: []int{1, 1, 1, 1, 1, 1, 1, 1}, cancel: []int{6, 5, 4}},
		{nested: []int{0, 0, 0, 0, 4, 0, 0, 0}, cancel: []int{3, 2, 1}},
		{nested: []int{2, 2, 2, 2, 2, 2, 2, 2}, cancel: []int{0, 7}},
	} {
		t.Run(fmt.Sprintf("%d", trial), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("interleave%d", trial)
			holder := heldMutex(t, ctx, admin, name)
			n := len(pattern.nested)
			ms := make([]*etcdsync.Mutex, n)
			got := make([]chan error, n)
			cancels := make([]context.CancelFunc, n)
			var order []int
			var mu sync.Mutex
			var inside atomic.Int32
			release := make([]chan struct{}, n)
			var waiters sync.WaitGroup // every Unlock returns before the sessions close
			released := make([]bool, n)
			defer func() { // also after a failed check: nobody is left waiting
				for i := range release {
					if release[i] != nil && !released[i] {
						cancels[i]()
						close(release[i])
					}
				}
				waiters.Wait()
			}()
			put := 0
			for i := range ms {
				for j := range pattern.nested[i] {
					k := fmt.Sprintf("%s/n%d/%d", name, i, j)
					if j%2 == 1 {
						k = fmt.Sprintf("%s/zz%d-%d", name, i, j) // a direct child, not hex
					}
					_, err := admin.Put(ctx, k, "x")
					require.NoError(t, err)
					put++
				}
				ms[i] = etcdsync.NewMutex(session(t, admin), name)
				cctx, cancel := context.WithCancel(ctx)
				cancels[i] = cancel
				got[i] = make(chan error, 1)
				release[i] = make(chan struct{})
				waiters.Go(func() {
					err := ms[i].Lock(cctx)
					if err == nil {
						if inside.Add(1) != 1 {
							t.Errorf("waiter %d holds with another holding", i)
						}
						mu.Lock()
						order = append(order, i)
						mu.Unlock()
						got[i] <- nil
						<-release[i]
						inside.Add(-1)
						err = ms[i].Unlock(ctx)
						if err != nil {
							t.Errorf("waiter %d: unlock: %v", i, err)
						}
						return
					}
					got[i] <- err
				})
				waitKeys(t, admin, name+"/", 1+put+i+1)
			}
			cancelled := map[int]bool{}
			for _, i := range pattern.cancel {
				cancels[i]()
				require.ErrorIs(t, resultWithin(t, got[i], testTimeout, fmt.Sprintf("cancelled waiter %d", i)), context.Canceled)
				cancelled[i] = true
			}
			require.NoError(t, holder.Unlock(ctx))
			for i := range ms {
				if cancelled[i] {
					continue
				}
				require.NoError(t, resultWithin(t, got[i], testTimeout, fmt.Sprintf("waiter %d holds", i)))
				time.Sleep(20 * time.Millisecond) // let anyone wrongly woken show up
				close(release[i])
				released[i] = true
			}
			var want []int
			for i := range ms {
				if !cancelled[i] {
					want = append(want, i)
				}
			}
			mu.Lock()
			require.Equal(t, want, order)
			mu.Unlock()
			waitCount(t, admin, name+"/", testTimeout, func(have int) bool { return have == put })
		})
	}
}

// Under every deployment (namespace, gRPC proxy, in-process client, wrapped
// client; not the etcd binaries) a queue longer than listLimit with keys of
// nested names between the waiters is served in order, one at a time, and
// TryLock on it is refused; nothing is left.
func TestLimitedListsUnderEveryDeployment(t *testing.T) {
	t.Parallel()
	for _, rig := range compatRigs() {
		if rig.external {
			continue
		}
		t.Run(rig.name, func(t *testing.T) {
			t.Parallel()
			d := rig.start(t)
			ctx := ctxT(t)
			cli := d.newClient(t)
			const name = "limited"
			holder := etcdsync.NewMutex(session(t, cli), name)
			require.NoError(t, holder.Lock(ctx))
			const n = 6
			ms := make([]*etcdsync.Mutex, n)
			got := make([]<-chan error, n)
			for i := range ms {
				for j := range 2 {
					_, err := cli.Put(ctx, fmt.Sprintf("%s/x%d/%d", name, i, j), "nested")
					require.NoError(t, err)
				}
				ms[i] = etcdsync.NewMutex(session(t, d.newClient(t)), name)
				got[i] = async(func() error { return ms[i].Lock(ctx) })
				waitKeys(t, cli, name+"/", 1+3*(i+1))
			}
			require.ErrorIs(t, etcdsync.NewMutex(session(t, cli), name).TryLock(ctx), etcdsync.ErrLocked)
			notYet(t, got[0], 200*time.Millisecond, "waiter 0 holds while the holder holds")
			require.NoError(t, holder.Unlock(ctx))
			for i := range ms {
				require.NoError(t, resultWithin(t, got[i], testTimeout, fmt.Sprintf("waiter %d holds", i)))
				for j := i + 1; j < n; j++ {
					notYet(t, got[j], 0, fmt.Sprintf("waiter %d holds with waiter %d holding", j, i))
				}
				require.NoError(t, ms[i].Unlock(ctx))
			}
			_, err := cli.Delete(ctx, name+"/", clientv3.WithPrefix())
			require.NoError(t, err)
			require.Empty(t, rawKeys(t, d, name))
		})
	}
}

package etcdsync_test

// What a contender lists of the queue: under a Mutex or an Election only the
// newest keys up to its own (a reply that does not grow with the queue), and
// every key when those do not settle who blocks it (keys of nested names, a
// key of its own that existed before newer ones).

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
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

// directChildren returns the keys NAME/<hex> under name.
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

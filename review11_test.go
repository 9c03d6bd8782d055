package etcdsync_test

// Review 11: attacks on the wait loop of a16f927 (a waiter watches its
// predecessor and second-nearest key; when the second-nearest goes while all
// keys still listed are watched, it drops it from the list without a read).

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// r11Key is the key of session s on name.
func r11Key(name string, s *etcdsync.Session) string {
	return fmt.Sprintf("%s/%x", name, int64(s.Lease()))
}

// r11Wait returns the first result of q within d, or fails.
func r11Wait(t *testing.T, q *queued, d time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-q.err:
		return err
	case <-time.After(d):
		t.Fatalf("%s: waiter %d did not return within %v", what, q.i, d)
		return nil
	}
}

// r11NotYet fails if q returns within d.
func r11NotYet(t *testing.T, q *queued, d time.Duration, what string) {
	t.Helper()
	select {
	case err := <-q.err:
		t.Fatalf("%s: waiter %d returned (%v), must still wait", what, q.i, err)
	case <-time.After(d):
	}
}

// Predecessor and second-nearest deleted in one Txn: the third waiter gets
// two deletes at one revision; whichever arrives first takes the no-read
// branch, the second confirms. It must hold (the RPCs it made are logged;
// TestNoRPCOnTheCriticalPath asserts none).
func TestR11SameRevPredAndSecond(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("r11same%d", round)
			hs := session(t, admin)
			holder := etcdsync.NewMutex(hs, name)
			require.NoError(t, holder.Lock(ctx))
			held := make(chan struct{}, 2)
			var holding, atHold atomic.Int64
			qs := enqueue(t, c, name, 2, func(int) context.Context { return ctx }, func(q *queued) error {
				if holding.Add(1) != 1 {
					t.Errorf("waiter %d holds with another", q.i)
				}
				held <- struct{}{}
				if q.i == 1 {
					atHold.Store(q.cnt.unary.Load())
				}
				holding.Add(-1)
				return q.m.Unlock(ctx)
			})
			before := qs[1].cnt.unary.Load()
			_, err := admin.Txn(ctx).Then(clientv3.OpDelete(r11Key(name, hs)), clientv3.OpDelete(r11Key(name, qs[0].s))).Commit()
			require.NoError(t, err)
			require.ErrorIs(t, r11Wait(t, qs[0], testTimeout, "deleted waiter"), etcdsync.ErrSessionExpired)
			require.NoError(t, r11Wait(t, qs[1], testTimeout, "third waiter"))
			t.Logf("waiter 1: %d unary RPCs between the delete and its hold", atHold.Load()-before)
			require.Empty(t, keys(t, admin, name+"/"))
		})
	}
}

// Predecessor, second-nearest and our own key deleted in one Txn: the
// waiter must return ErrSessionExpired and never hold.
func TestR11SameRevWithOwnKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("r11own%d", round)
			hs := session(t, admin)
			holder := etcdsync.NewMutex(hs, name)
			require.NoError(t, holder.Lock(ctx))
			qs := enqueue(t, c, name, 2, func(int) context.Context { return ctx }, func(q *queued) error {
				t.Errorf("waiter %d held although its key went with the keys ahead", q.i)
				return q.m.Unlock(ctx)
			})
			ops := []clientv3.Op{clientv3.OpDelete(r11Key(name, hs)), clientv3.OpDelete(r11Key(name, qs[0].s)), clientv3.OpDelete(r11Key(name, qs[1].s))}
			if round%2 == 1 {
				slices.Reverse(ops)
			}
			_, err := admin.Txn(ctx).Then(ops...).Commit()
			require.NoError(t, err)
			for _, q := range qs {
				require.ErrorIs(t, r11Wait(t, q, testTimeout, "deleted waiter"), etcdsync.ErrSessionExpired)
			}
		})
	}
}

// gatedClient holds back the creation of watches on keys other than own
// (set once the session exists) while gate is armed, until open is closed.
type gatedClient struct {
	own   atomic.Value // string
	armed atomic.Bool
	held  chan struct{} // one send per held create
	open  chan struct{}
}

func (g *gatedClient) dial() grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil {
			return nil, err
		}
		return &gatedStream{ClientStream: s, g: g}, nil
	})
}

type gatedStream struct {
	grpc.ClientStream
	g *gatedClient
}

func (s *gatedStream) SendMsg(m any) error {
	if wr, ok := m.(*pb.WatchRequest); ok && s.g.armed.Load() {
		if cr := wr.GetCreateRequest(); cr != nil {
			if own, _ := s.g.own.Load().(string); string(cr.Key) != own {
				select {
				case s.g.held <- struct{}{}:
				default:
				}
				select {
				case <-s.g.open:
				case <-time.After(testTimeout):
				}
			}
		}
	}
	return s.ClientStream.SendMsg(m)
}

// Keys ahead deleted between the waiter's read and the creation of their
// watches: the creation response is past the read, so it must read again.
// (a) both keys ahead go: it must hold. (b) only the second-nearest goes:
// it must wait for its predecessor, then hold.
func TestR11DeletedBeforeWatchCreated(t *testing.T) {
	t.Parallel()
	for _, both := range []bool{true, false} {
		t.Run(fmt.Sprintf("both=%v", both), func(t *testing.T) {
			c := single(t)
			admin := c.Client(t)
			ctx := ctxT(t)
			name := "r11gate"
			hs := session(t, admin)
			holder := etcdsync.NewMutex(hs, name)
			require.NoError(t, holder.Lock(ctx))
			ps := session(t, admin)
			pred := etcdsync.NewMutex(ps, name)
			predErr := make(chan error, 1)
			go func() { predErr <- pred.Lock(ctx) }()
			waitKeys(t, admin, name+"/", 2)
			g := &gatedClient{held: make(chan struct{}, 4), open: make(chan struct{})}
			ws := session(t, c.Client(t, g.dial()))
			g.own.Store(r11Key(name, ws))
			g.armed.Store(true)
			w := etcdsync.NewMutex(ws, name)
			werr := make(chan error, 1)
			go func() { werr <- w.Lock(ctx) }()
			within(t, g.held, testTimeout, "a watch create of a key ahead held back")
			if both {
				_, err := admin.Txn(ctx).Then(clientv3.OpDelete(r11Key(name, hs)), clientv3.OpDelete(r11Key(name, ps))).Commit()
				require.NoError(t, err)
			} else {
				require.NoError(t, holder.Unlock(ctx))
				select {
				case err := <-predErr:
					require.NoError(t, err)
				case <-time.After(testTimeout):
					t.Fatal("pred did not get the lock")
				}
			}
			g.armed.Store(false)
			close(g.open)
			if !both {
				select {
				case err := <-werr:
					t.Fatalf("waiter returned (%v) while its predecessor holds", err)
				case <-time.After(2 * time.Second):
				}
				require.NoError(t, pred.Unlock(ctx))
			} else {
				select {
				case err := <-predErr:
					require.ErrorIs(t, err, etcdsync.ErrSessionExpired)
				case <-time.After(testTimeout):
					t.Fatal("pred did not return")
				}
			}
			select {
			case err := <-werr:
				require.NoError(t, err)
			case <-time.After(testTimeout):
				t.Fatal("waiter waits forever while nothing blocks it")
			}
			require.NoError(t, w.Unlock(ctx))
		})
	}
}

package etcdsync_test

import (
	"context"
	"sync"
	"testing"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// lateWatch delivers a waiter's watch stream as etcd may: the first delete
// reported by watch `late` is held back until a delete reported by watch
// `early` has been delivered, then follows it. The server does this when
// the later watch's creation is not yet sent (its events wait, the other
// watches' go on: v3rpc/watch.go, sendLoop's pending).
type lateWatch struct {
	grpc.ClientStream
	early, late int64
	created     chan<- int64
	held, next  *pb.WatchResponse
	done        bool
}

func (w *lateWatch) RecvMsg(m any) error {
	out := m.(*pb.WatchResponse)
	give := func(in *pb.WatchResponse) error {
		proto.Reset(out)
		proto.Merge(out, in)
		return nil
	}
	if in := w.next; in != nil {
		w.next = nil
		return give(in)
	}
	for {
		in := &pb.WatchResponse{}
		if err := w.ClientStream.RecvMsg(in); err != nil {
			return err
		}
		if in.Created {
			w.created <- in.WatchId
		}
		switch {
		case w.done || len(in.Events) == 0:
		case in.WatchId == w.late && w.held == nil:
			w.held = in
			continue
		case in.WatchId == w.early && w.held != nil:
			w.next, w.held, w.done = w.held, nil, true
		}
		return give(in)
	}
}

// TestTurnAfterEveryDeleteSeen: a waiter watches the two nearest keys ahead
// (watch 2 the older, watch 3 the newer). The newer goes first, then the
// older; the stream delivers the older's delete first. The hold begins at
// the later delete, and Header says so: never at the earlier one, while the
// older key still existed. Mutex (the newer key a waiter that gives up) and
// RWMutex (a writer behind two readers).
func TestTurnAfterEveryDeleteSeen(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	type lock interface {
		Lock(context.Context) error
		Header() *pb.ResponseHeader
	}
	cases := []struct {
		name string
		// ahead makes the two keys ahead (older first) and returns the
		// calls that delete them.
		ahead  func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (older, newer func())
		waiter func(s *etcdsync.Session, name string) lock
	}{
		{name: "mutex", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			m1, m2 := etcdsync.NewMutex(s1, name), etcdsync.NewMutex(s2, name)
			require.NoError(t, m1.Lock(ctx))
			wctx, cancel := context.WithCancel(ctx)
			gaveUp := make(chan error, 1)
			go func() { gaveUp <- m2.Lock(wctx) }()
			waitKeys(t, admin, name+"/", 2)
			return func() { require.NoError(t, m1.Unlock(ctx)) },
				func() { cancel(); require.ErrorIs(t, <-gaveUp, context.Canceled) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return etcdsync.NewMutex(s, name) }},
		{name: "rwmutex", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			r1, r2 := etcdsync.NewRWMutex(s1, name), etcdsync.NewRWMutex(s2, name)
			require.NoError(t, r1.RLock(ctx))
			require.NoError(t, r2.RLock(ctx))
			return func() { require.NoError(t, r1.RUnlock(ctx)) }, func() { require.NoError(t, r2.RUnlock(ctx)) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return etcdsync.NewRWMutex(s, name) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			name := "reorder/" + tc.name
			var mu sync.Mutex
			armed := false
			created := make(chan int64, 16)
			cli := etcdtest.NewClient(t, c.Endpoints(), grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				cs, err := streamer(ctx, desc, cc, method, opts...)
				mu.Lock()
				defer mu.Unlock()
				if err != nil || method != "/etcdserverpb.Watch/Watch" || !armed {
					return cs, err
				}
				armed = false
				return &lateWatch{ClientStream: cs, early: 2, late: 3, created: created}, nil
			}))
			older, newer := tc.ahead(t, ctx, session(t, admin), session(t, admin), name)
			w := tc.waiter(session(t, cli), name)
			mu.Lock()
			armed = true
			mu.Unlock()
			locked := make(chan error, 1)
			go func() { locked <- w.Lock(ctx) }()
			for seen := map[int64]bool{}; !seen[1] || !seen[2] || !seen[3]; {
				select {
				case id := <-created:
					seen[id] = true
				case <-ctx.Done():
					t.Fatal("the waiter's three watches were not created")
				}
			}
			newer()
			older()
			resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
			require.NoError(t, err)
			last := resp.Header.Revision // the older key's delete
			require.NoError(t, <-locked)
			require.GreaterOrEqual(t, w.Header().Revision, last, "the hold began before the older key's delete")
		})
	}
}

package tests

// The wrapped-client deployment of the compatibility matrix: a client whose
// KV, Watcher, Lease and Maintenance are wrapped, checking that every call
// of the library goes through the wrappers.

import (
	"context"
	"sync"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
)

// wrapCalls wraps a client's KV, Watcher, Lease and Maintenance with user
// interceptors that mark each call's context, and checks at the gRPC layer
// (unary and stream interceptors) that every RPC the client sends carries
// the mark: a request the library sends around the client's interfaces
// does not.
type wrapCalls struct {
	mu       sync.Mutex
	calls    map[string]int // through the interfaces, by method
	bypassed []string       // RPCs without the mark
}

type wrapMark struct{}

func (w *wrapCalls) mark(ctx context.Context, method string) context.Context {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.calls == nil {
		w.calls = make(map[string]int)
	}
	w.calls[method]++
	return context.WithValue(ctx, wrapMark{}, true)
}

func (w *wrapCalls) seen(ctx context.Context, method string) {
	if ctx.Value(wrapMark{}) != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.bypassed = append(w.bypassed, method)
}

func (w *wrapCalls) dial() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			w.seen(ctx, method)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			w.seen(ctx, method)
			return streamer(ctx, desc, cc, method, opts...)
		}),
	}
}

// count returns how many calls of method went through the interfaces.
func (w *wrapCalls) count(method string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.calls[method]
}

// wrappedClient returns a client of endpoints whose interfaces are wrapped
// (calls sees what goes through them) and whose RPCs cnt counts (each
// watch created: cnt.created, with room for 16).
func wrappedClient(t *testing.T, endpoints []string) (*clientv3.Client, *wrapCalls, *counter) {
	calls := &wrapCalls{}
	cnt := &counter{created: make(chan struct{}, 16)}
	return calls.wrap(etcdtest.NewClient(t, endpoints, append(calls.dial(), cnt.dial()...)...)), calls, cnt
}

// check fails t when an RPC went around the interfaces, and resets.
func (w *wrapCalls) check(t *testing.T) {
	t.Helper()
	w.mu.Lock()
	bypassed, calls := w.bypassed, w.calls
	w.bypassed, w.calls = nil, nil
	w.mu.Unlock()
	require.Empty(t, bypassed, "RPCs that went around the client's interfaces (calls through them: %v)", calls)
	require.NotEmpty(t, calls)
}

func (w *wrapCalls) wrap(cli *clientv3.Client) *clientv3.Client {
	cli.KV = wrapKV{cli.KV, w}
	cli.Watcher = wrapWatcher{cli.Watcher, w}
	cli.Lease = wrapLease{cli.Lease, w}
	cli.Maintenance = wrapMaintenance{cli.Maintenance, w}
	return cli
}

type wrapKV struct {
	clientv3.KV
	w *wrapCalls
}

func (k wrapKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	return k.KV.Get(k.w.mark(ctx, "Get"), key, opts...)
}

func (k wrapKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	return k.KV.Put(k.w.mark(ctx, "Put"), key, val, opts...)
}

func (k wrapKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	return k.KV.Delete(k.w.mark(ctx, "Delete"), key, opts...)
}

func (k wrapKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	return k.KV.Do(k.w.mark(ctx, "Do"), op)
}

func (k wrapKV) Txn(ctx context.Context) clientv3.Txn { return k.KV.Txn(k.w.mark(ctx, "Txn")) }

type wrapWatcher struct {
	clientv3.Watcher
	w *wrapCalls
}

func (ww wrapWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	return ww.Watcher.Watch(ww.w.mark(ctx, "Watch"), key, opts...)
}

func (ww wrapWatcher) RequestProgress(ctx context.Context) error {
	return ww.Watcher.RequestProgress(ww.w.mark(ctx, "RequestProgress"))
}

type wrapLease struct {
	clientv3.Lease
	w *wrapCalls
}

func (l wrapLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	return l.Lease.Grant(l.w.mark(ctx, "Grant"), ttl)
}

func (l wrapLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	return l.Lease.Revoke(l.w.mark(ctx, "Revoke"), id)
}

func (l wrapLease) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	return l.Lease.TimeToLive(l.w.mark(ctx, "TimeToLive"), id, opts...)
}

func (l wrapLease) KeepAlive(ctx context.Context, id clientv3.LeaseID) (<-chan *clientv3.LeaseKeepAliveResponse, error) {
	return l.Lease.KeepAlive(l.w.mark(ctx, "KeepAlive"), id)
}

func (l wrapLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	return l.Lease.KeepAliveOnce(l.w.mark(ctx, "KeepAliveOnce"), id)
}

type wrapMaintenance struct {
	clientv3.Maintenance
	w *wrapCalls
}

func (m wrapMaintenance) Status(ctx context.Context, endpoint string) (*clientv3.StatusResponse, error) {
	return m.Maintenance.Status(m.w.mark(ctx, "Status"), endpoint)
}

package etcdsync_test

// The fault-injection kit of the tests: gRPC interceptors that fail, hold
// back, re-route or break a client's calls and watch streams, a proxied
// client, and a 3-member cluster whose members can be cut off from peers.

import (
	"context"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

const txnMethod = "/etcdserverpb.KV/Txn"

// injector fails the next n calls of one unary method of a client with
// Unavailable, before they are sent: the server never sees them.
type injector struct {
	mu     sync.Mutex
	method string
	n      int
}

func (in *injector) arm(method string, n int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.method, in.n = method, n
}

// take reports whether a call of method is one of the next n armed.
func (in *injector) take(method string) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	hit := in.n > 0 && method == in.method
	if hit {
		in.n--
	}
	return hit
}

func (in *injector) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if in.take(method) {
			return status.Error(codes.Unavailable, "injected")
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// watchVia sends the Watch streams of a client to another connection (a
// chosen member) and leaves its other calls where they were, as a client
// balancing requests over members may do. Each watch created on those streams
// is reported on created, if non-nil.
func watchVia(conn *grpc.ClientConn, created chan<- struct{}) grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method != "/etcdserverpb.Watch/Watch" {
			return streamer(ctx, desc, cc, method, opts...)
		}
		s, err := conn.NewStream(ctx, desc, method, opts...)
		if err != nil || created == nil {
			return s, err
		}
		return &createdStream{ClientStream: s, created: created}, nil
	})
}

type createdStream struct {
	grpc.ClientStream
	created chan<- struct{}
}

func (s *createdStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if wr, ok := m.(*pb.WatchResponse); ok && err == nil && wr.Created {
		s.created <- struct{}{}
	}
	return err
}

// unaryVia sends the next n calls of one unary method of a client to another
// connection (a chosen member).
type unaryVia struct {
	conn *grpc.ClientConn
	injector
}

func (u *unaryVia) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if u.take(method) {
			return u.conn.Invoke(ctx, method, req, reply, opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// peerRig is a 3-member cluster whose members can be cut off from their
// peers, with a follower f and another member u.
func peerRig(t *testing.T) (c *etcdtest.Cluster, f, u *etcdtest.Member) {
	if testing.Short() {
		t.Skip("3-member cluster skipped in -short")
	}
	c = etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	f = c.Follower()
	require.NotNil(t, f)
	for _, m := range c.Members() {
		if m != f {
			u = m
		}
	}
	return c, f, u
}

// caughtUp waits until member m has applied revision rev.
func caughtUp(t *testing.T, m *etcdtest.Member, rev int64) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for m.Rev() < rev {
		require.True(t, time.Now().Before(deadline), "%s did not reach revision %d", m.Name, rev)
		time.Sleep(10 * time.Millisecond) // polling the member's applied revision
	}
}

// script runs a hook around the next calls of one unary method of a
// client: hooks[i] handles the i-th call from arming on; it gets the call's
// invoker (which sends it where the client would) and returns the call's
// error. Calls past the hooks go through unchanged.
type script struct {
	mu     sync.Mutex
	method string
	hooks  []func(c call) error
}

// call is one intercepted call: invoke sends it where the client would, on
// sends it on another connection.
type call struct {
	invoke func() error
	on     func(conn *grpc.ClientConn) error
}

func (s *script) arm(method string, hooks ...func(c call) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.method, s.hooks = method, hooks
}

func (s *script) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		s.mu.Lock()
		var hook func(call) error
		if method == s.method && len(s.hooks) > 0 {
			hook, s.hooks = s.hooks[0], s.hooks[1:]
		}
		s.mu.Unlock()
		c := call{
			invoke: func() error { return invoker(ctx, method, req, reply, cc, opts...) },
			on:     func(conn *grpc.ClientConn) error { return conn.Invoke(ctx, method, req, reply, opts...) },
		}
		if hook == nil {
			return c.invoke()
		}
		return hook(c)
	})
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

// streamBreaker fails the Watch streams of a client at one chosen point: once
// armed, the first stream that receives a response with a DELETE event fails
// its next receive (as a member restart or a lost leader does); the watch ID
// of that first delete is reported on first. Each Created response is
// reported on created.
type streamBreaker struct {
	armed   atomic.Bool
	first   chan int64
	created chan struct{}
}

func (b *streamBreaker) dial() grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil || method != "/etcdserverpb.Watch/Watch" {
			return s, err
		}
		return &breakingStream{ClientStream: s, b: b}, nil
	})
}

type breakingStream struct {
	grpc.ClientStream
	b        *streamBreaker
	failNext bool
}

func (s *breakingStream) RecvMsg(m any) error {
	if s.failNext {
		return status.Error(codes.Unavailable, "injected: the watch stream broke")
	}
	err := s.ClientStream.RecvMsg(m)
	wr, ok := m.(*pb.WatchResponse)
	if err != nil || !ok {
		return err
	}
	if wr.Created {
		s.b.created <- struct{}{}
	}
	for _, ev := range wr.Events {
		if ev.Type == mvccpb.DELETE && s.b.armed.CompareAndSwap(true, false) {
			s.failNext = true
			s.b.first <- wr.WatchId
			break
		}
	}
	return nil
}

// deleteGate holds back, while armed, Txns whose success branch deletes (an
// Unlock/Resign), until their context ends or open closes.
type deleteGate struct {
	armed atomic.Bool
	held  chan struct{}
	open  chan struct{}
}

func newDeleteGate() *deleteGate {
	return &deleteGate{held: make(chan struct{}, 8), open: make(chan struct{})}
}

func (g *deleteGate) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if tr, ok := req.(*pb.TxnRequest); ok && g.armed.Load() {
			del := false
			for _, op := range tr.Success {
				if op.GetRequestDeleteRange() != nil {
					del = true
				}
			}
			if del {
				select {
				case g.held <- struct{}{}:
				default:
				}
				select {
				case <-g.open:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// proxied returns a client of c's first member through a proxy.
func proxied(t *testing.T, c *etcdtest.Cluster) (*clientv3.Client, *etcdtest.Proxy) {
	t.Helper()
	u, err := url.Parse(c.Members()[0].Endpoint())
	require.NoError(t, err)
	p := etcdtest.NewProxy(t, u.Host)
	return etcdtest.NewClient(t, []string{p.Endpoint()}), p
}

// routedClient returns a client whose watch streams go to member watch
// and whose unary calls go to member unary (-1: balanced over all), with
// cnt counting (cnt may be nil).
func routedClient(t *testing.T, c *etcdtest.Cluster, watch, unary int, cnt *counter) *clientv3.Client {
	t.Helper()
	wcli := etcdtest.NewClient(t, []string{c.Member(watch).Endpoint()})
	var ucli *clientv3.Client
	if unary >= 0 {
		ucli = etcdtest.NewClient(t, []string{c.Member(unary).Endpoint()})
	}
	route := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method == "/etcdserverpb.Watch/Watch" {
			return wcli.ActiveConnection().NewStream(ctx, desc, method, opts...)
		}
		return streamer(ctx, desc, cc, method, opts...)
	})
	uroute := grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if ucli != nil {
			return ucli.ActiveConnection().Invoke(ctx, method, req, reply, opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	var dial []grpc.DialOption
	if cnt != nil {
		dial = append(dial, cnt.dial()...)
	}
	dial = append(dial, route, uroute)
	return etcdtest.NewClient(t, c.Endpoints(), dial...)
}

// sentClient returns a client of c's first member through a proxy whose
// unary calls report their method on the returned channel as they are sent.
func sentClient(t *testing.T, c *etcdtest.Cluster) (*clientv3.Client, *etcdtest.Proxy, chan string) {
	t.Helper()
	_, p := proxied(t, c)
	sent := make(chan string, 64)
	cli := etcdtest.NewClient(t, []string{p.Endpoint()}, grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		select {
		case sent <- method:
		default:
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}))
	return cli, p, sent
}

// awaitSent drains sent until method is sent.
func awaitSent(t *testing.T, sent chan string, method string) {
	t.Helper()
	for m := ""; m != method; {
		select {
		case m = <-sent:
		case <-time.After(testTimeout):
			t.Fatalf("%s not sent", method)
		}
	}
}

func drainSent(sent chan string) {
	for len(sent) > 0 {
		<-sent
	}
}

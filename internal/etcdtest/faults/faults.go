// Package faults is the fault-injection kit of etcdsync's tests: gRPC
// interceptors, given to a client as grpc.DialOption values, that fail,
// delay, hold back, re-route, reorder or break its unary calls and Watch
// streams; clients through a TCP proxy the test can cut or slow; and a
// 3-member cluster whose members can be cut off from their peers.
//
// The injectors (Injector, UnaryVia, Script, GatedClient, StreamBreaker,
// DeleteGate, LateClient) let every call through unchanged until the test
// arms them; the routes (WatchVia, Router, RoutedClient) and Delay act from
// the start. Each says what it holds a call or a stream back for, and until
// when; the waits of the kit's own (AwaitSent, CaughtUp, a GatedClient's
// hold) end after Timeout at the most. It runs on the embedded etcd members
// of internal/etcdtest.
package faults

import (
	"context"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
)

// Timeout bounds the kit's own waits (AwaitSent, CaughtUp, a GatedClient's
// hold), and every wait of the root package's tests (their testTimeout).
const Timeout = 20 * time.Second

// The gRPC methods the tests aim faults at.
const (
	TxnMethod   = "/etcdserverpb.KV/Txn"
	RangeMethod = "/etcdserverpb.KV/Range"
	WatchMethod = "/etcdserverpb.Watch/Watch"
)

// Unavailable returns the error of an injected fault: gRPC's Unavailable,
// as a lost connection gives, with "injected" and what in its message. It
// does not block.
func Unavailable(what string) error {
	if what == "" {
		return status.Error(codes.Unavailable, "injected")
	}
	return status.Error(codes.Unavailable, "injected: "+what)
}

// Injector fails the next n calls of one unary method of a client with
// Unavailable, before they are sent: the server never sees them. The zero
// value is ready and fails nothing until Arm. It never blocks.
type Injector struct {
	mu     sync.Mutex
	method string
	n      int
}

// Arm makes the next n calls of method fail (n 0 or method "": none),
// replacing what was armed before. It does not block.
func (in *Injector) Arm(method string, n int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.method, in.n = method, n
}

// take reports whether a call of method is one of the next n armed.
func (in *Injector) take(method string) bool {
	in.mu.Lock()
	defer in.mu.Unlock()
	hit := in.n > 0 && method == in.method
	if hit {
		in.n--
	}
	return hit
}

// Dial returns the interceptor to dial the client with.
func (in *Injector) Dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if in.take(method) {
			return Unavailable("")
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// UnaryVia sends the next n calls (Arm) of one unary method of a client to
// another connection, Conn (a chosen member), instead of where the client
// would send them. It never blocks.
type UnaryVia struct {
	Conn *grpc.ClientConn
	Injector
}

// Dial returns the interceptor to dial the client with.
func (u *UnaryVia) Dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if u.take(method) {
			return u.Conn.Invoke(ctx, method, req, reply, opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// WatchVia sends the Watch streams of a client to another connection (a
// chosen member) and leaves its other calls where they were, as a client
// balancing requests over members may do. Each watch created on those streams
// is reported on created, if non-nil: the stream's receive blocks until the
// report is taken (give created room).
func WatchVia(conn *grpc.ClientConn, created chan<- struct{}) grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method != WatchMethod {
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

// Router sends a client's Watch streams and its unary calls to the
// connections of its last Route, or where the client would send them (nil),
// as a client balancing its calls over members may do. The zero value routes
// nothing. It never blocks; a stream keeps the connection it opened on.
type Router struct {
	watch, unary atomic.Pointer[grpc.ClientConn]
}

// Route sends the Watch streams opened from now on to watch and the unary
// calls to unary; nil leaves them to the client. It does not block.
func (r *Router) Route(watch, unary *grpc.ClientConn) {
	r.watch.Store(watch)
	r.unary.Store(unary)
}

// Dial returns the interceptors to dial the client with.
func (r *Router) Dial() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if to := r.watch.Load(); to != nil && method == WatchMethod {
				return to.NewStream(ctx, desc, method, opts...)
			}
			return streamer(ctx, desc, cc, method, opts...)
		}),
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			if to := r.unary.Load(); to != nil {
				return to.Invoke(ctx, method, req, reply, opts...)
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
	}
}

// RoutedClient returns a client of c whose Watch streams go to member watch
// and whose unary calls go to member unary (-1: balanced over all), with
// the extra dial options (a counter's interceptors, say) outside the
// routing: a Router set once. It and the connections to the two members it
// routes to are closed in t's cleanup; it returns once they are made.
func RoutedClient(t testing.TB, c *etcdtest.Cluster, watch, unary int, dial ...grpc.DialOption) *clientv3.Client {
	t.Helper()
	wconn := etcdtest.Conn(t, c.Member(watch).Endpoint())
	var uconn *grpc.ClientConn
	if unary >= 0 {
		uconn = etcdtest.Conn(t, c.Member(unary).Endpoint())
	}
	var r Router
	r.Route(wconn, uconn)
	return etcdtest.NewClient(t, c.Endpoints(), append(dial, r.Dial()...)...)
}

// Delay holds back every call of one unary method of a client by d before
// it is sent: the call blocks for d, or until its context ends (it then
// fails with the context's error, unsent).
func Delay(method string, d time.Duration) grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if m == method {
			select {
			case <-time.After(d):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return invoker(ctx, m, req, reply, cc, opts...)
	})
}

// Script runs a hook around the next calls of one unary method of a
// client: the i-th hook of Arm handles the i-th call from arming on, and
// returns the call's error. Calls past the hooks go through unchanged. The
// zero value is ready. A call blocks for as long as its hook does.
type Script struct {
	mu     sync.Mutex
	method string
	hooks  []func(c Call) error
}

// Call is one call a Script's hook handles: Invoke sends it where the
// client would, On sends it on another connection; either returns the
// call's error.
type Call struct {
	Invoke func() error
	On     func(conn *grpc.ClientConn) error
}

// Pass is a hook that sends the call where the client would; it blocks
// until the call is answered.
func Pass(c Call) error { return c.Invoke() }

// Fail is a hook that fails the call with Unavailable, unsent, at once.
func Fail(Call) error { return Unavailable("") }

// ReplyLost is a hook that sends the call and, once it is answered (it
// blocks until then), fails it with Unavailable: it did what it asked,
// but its caller does not know.
func ReplyLost(c Call) error {
	if err := c.Invoke(); err != nil {
		return err
	}
	return Unavailable("reply lost")
}

// Via returns a hook that sends the call on conn (a chosen member); it
// blocks until the call is answered.
func Via(conn *grpc.ClientConn) func(Call) error {
	return func(c Call) error { return c.On(conn) }
}

// Arm sets the hooks of the next calls of method, replacing those left. It
// does not block.
func (s *Script) Arm(method string, hooks ...func(c Call) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.method, s.hooks = method, hooks
}

// Dial returns the interceptor to dial the client with.
func (s *Script) Dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		s.mu.Lock()
		var hook func(Call) error
		if method == s.method && len(s.hooks) > 0 {
			hook, s.hooks = s.hooks[0], s.hooks[1:]
		}
		s.mu.Unlock()
		c := Call{
			Invoke: func() error { return invoker(ctx, method, req, reply, cc, opts...) },
			On:     func(conn *grpc.ClientConn) error { return conn.Invoke(ctx, method, req, reply, opts...) },
		}
		if hook == nil {
			return c.Invoke()
		}
		return hook(c)
	})
}

// GatedClient holds back the creation of watches on keys other than Own
// while Armed: each such create request blocks its stream's send until Open
// is closed (or Timeout passes), and is reported on Held first (dropped
// when Held is full).
type GatedClient struct {
	Own   atomic.Value // string: the key whose watches pass (set once the session exists)
	Armed atomic.Bool
	Held  chan struct{}
	Open  chan struct{}
}

// NewGatedClient returns an unarmed gate, Held with room for 4 reports.
func NewGatedClient() *GatedClient {
	return &GatedClient{Held: make(chan struct{}, 4), Open: make(chan struct{})}
}

// Dial returns the interceptor to dial the client with.
func (g *GatedClient) Dial() grpc.DialOption {
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
	g *GatedClient
}

func (s *gatedStream) SendMsg(m any) error {
	if wr, ok := m.(*pb.WatchRequest); ok && s.g.Armed.Load() {
		if cr := wr.GetCreateRequest(); cr != nil {
			if own, _ := s.g.Own.Load().(string); string(cr.Key) != own {
				select {
				case s.g.Held <- struct{}{}:
				default:
				}
				select {
				case <-s.g.Open:
				case <-time.After(Timeout):
				}
			}
		}
	}
	return s.ClientStream.SendMsg(m)
}

// StreamBreaker fails the Watch streams of a client at one chosen point:
// once Armed, the first stream that receives a response with a DELETE event
// fails its next receive with Unavailable (as a member restart or a lost
// leader does), and the watch ID of that first delete is reported on First.
// Each Created response is reported on Created. A stream's receive blocks
// until its report is taken.
type StreamBreaker struct {
	Armed   atomic.Bool
	First   chan int64
	Created chan struct{}
}

// NewStreamBreaker returns an unarmed breaker, First with room for 1 report
// and Created for 16.
func NewStreamBreaker() *StreamBreaker {
	return &StreamBreaker{First: make(chan int64, 1), Created: make(chan struct{}, 16)}
}

// Dial returns the interceptor to dial the client with.
func (b *StreamBreaker) Dial() grpc.DialOption {
	return WrapStreams(WatchMethod, func(s grpc.ClientStream) grpc.ClientStream { return &breakingStream{ClientStream: s, b: b} })
}

// WrapStreams returns a dial option under which every stream of method (""
// for every method) that opens is wrapped by wrap, so a test can see or
// change what it sends and receives. It does not block.
func WrapStreams(method string, wrap func(grpc.ClientStream) grpc.ClientStream) grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, m, opts...)
		if err != nil || method != "" && m != method {
			return s, err
		}
		return wrap(s), nil
	})
}

type breakingStream struct {
	grpc.ClientStream
	b        *StreamBreaker
	failNext bool
}

func (s *breakingStream) RecvMsg(m any) error {
	if s.failNext {
		return Unavailable("the watch stream broke")
	}
	err := s.ClientStream.RecvMsg(m)
	wr, ok := m.(*pb.WatchResponse)
	if err != nil || !ok {
		return err
	}
	if wr.Created {
		s.b.Created <- struct{}{}
	}
	for _, ev := range wr.Events {
		if ev.Type == mvccpb.DELETE && s.b.Armed.CompareAndSwap(true, false) {
			s.failNext = true
			s.b.First <- wr.WatchId
			break
		}
	}
	return nil
}

// Gate holds back the unary calls it picks while it holds (from Hold to
// Pass or Release): each blocks until Release (and, should the gate hold
// again by then, the next) or its context's end, and is reported on Held
// first (dropped when Held is full).
type Gate struct {
	Held  chan struct{}
	picks func(req any) bool
	mu    sync.Mutex
	holds bool
	open  chan struct{} // closed by Release
	going int           // calls picked and let go, not returned yet
}

// NewDeleteGate returns a gate of the Txns whose success branch deletes
// (an Unlock, a Resign), passing them until Hold, Held with room for 8
// reports.
func NewDeleteGate() *Gate {
	return newGate(func(req any) bool {
		tr, ok := req.(*pb.TxnRequest)
		return ok && slices.ContainsFunc(tr.Success, func(op *pb.RequestOp) bool { return op.GetRequestDeleteRange() != nil })
	})
}

// NewUnaryGate returns a gate of every unary call (reads, writes, lease
// grants and revokes; not the streams' watches and keepalives), passing
// them until Hold, Held with room for 8 reports.
func NewUnaryGate() *Gate { return newGate(func(any) bool { return true }) }

func newGate(picks func(req any) bool) *Gate {
	return &Gate{Held: make(chan struct{}, 8), picks: picks, open: make(chan struct{})}
}

// Hold makes the calls picked from now on wait.
func (g *Gate) Hold() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.holds = true
}

// Drained blocks until no call the gate let go is in flight, polling; it
// fails t after Timeout. After Hold, no call it picks reaches the server
// later until Release.
func (g *Gate) Drained(t testing.TB) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for {
		g.mu.Lock()
		going := g.going
		g.mu.Unlock()
		if going == 0 {
			return
		}
		require.True(t, time.Now().Before(deadline), "%d calls let through the gate still in flight", going)
		time.Sleep(5 * time.Millisecond) // polling the calls in flight
	}
}

// Pass lets the calls from now on pass; those held wait on.
func (g *Gate) Pass() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.holds = false
}

// Release lets the held calls go, and the calls from now on pass.
func (g *Gate) Release() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.holds = false
	close(g.open)
	g.open = make(chan struct{})
}

// Dial returns the interceptor to dial the client with.
func (g *Gate) Dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if !g.picks(req) {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		g.mu.Lock()
		for held := false; g.holds; held = true {
			open := g.open
			g.mu.Unlock()
			if !held {
				select {
				case g.Held <- struct{}{}:
				default:
				}
			}
			select {
			case <-open:
			case <-ctx.Done():
				return ctx.Err()
			}
			g.mu.Lock()
		}
		g.going++
		g.mu.Unlock()
		defer func() {
			g.mu.Lock()
			g.going--
			g.mu.Unlock()
		}()
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// LateClient returns a client of endpoints, closed in t's cleanup, whose
// first Watch stream opened after arm is called delivers as etcd may: the
// first response with events of watch late is held back until one with
// events of watch early has been delivered, then follows it. (The server
// does this when the later watch's creation is not yet sent: its events
// wait, the other watches' go on; v3rpc/watch.go, sendLoop's pending.) The
// ID of each watch created on that stream is reported on created; its
// receive blocks until the report is taken.
func LateClient(t testing.TB, endpoints []string, early, late int64, created chan<- int64) (cli *clientv3.Client, arm func()) {
	var mu sync.Mutex
	armed := false
	cli = etcdtest.NewClient(t, endpoints, grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, method, opts...)
		mu.Lock()
		defer mu.Unlock()
		if err != nil || method != WatchMethod || !armed {
			return cs, err
		}
		armed = false
		return &lateWatch{ClientStream: cs, early: early, late: late, created: created}, nil
	}))
	return cli, func() { mu.Lock(); armed = true; mu.Unlock() }
}

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
		// MessageV2Of: etcd's 3.5 messages are gogo (protobuf API v1), its
		// 3.6 and 3.7 messages API v2; CI runs both (.ci/clientline.sh).
		proto.Reset(protoadapt.MessageV2Of(out))
		proto.Merge(protoadapt.MessageV2Of(out), protoadapt.MessageV2Of(in))
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

// Proxied returns a client of c's first member, with the extra dial
// options, through a proxy the test can blackhole or slow, and the proxy;
// both end in t's cleanup. It returns once both are made.
func Proxied(t testing.TB, c *etcdtest.Cluster, dial ...grpc.DialOption) (*clientv3.Client, *etcdtest.Proxy) {
	t.Helper()
	p := Proxy(t, c)
	return etcdtest.NewClient(t, []string{p.Endpoint()}, dial...), p
}

// Proxy returns a new proxy to c's first member, for clients the test makes
// through it; it ends in t's cleanup.
func Proxy(t testing.TB, c *etcdtest.Cluster) *etcdtest.Proxy {
	t.Helper()
	u, err := url.Parse(c.Members()[0].Endpoint())
	require.NoError(t, err)
	return etcdtest.NewProxy(t, u.Host)
}

// SentClient is Proxied with a client whose unary calls report their method
// on the returned channel as they are sent (dropped when it is full, at 64).
func SentClient(t testing.TB, c *etcdtest.Cluster) (*clientv3.Client, *etcdtest.Proxy, chan string) {
	t.Helper()
	sent := make(chan string, 64)
	cli, p := Proxied(t, c, grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		select {
		case sent <- method:
		default:
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}))
	return cli, p, sent
}

// AwaitSent blocks until method is reported on sent (a SentClient's),
// taking the reports before it; it fails t after Timeout.
func AwaitSent(t testing.TB, sent chan string, method string) {
	t.Helper()
	for m := ""; m != method; {
		select {
		case m = <-sent:
		case <-time.After(Timeout):
			t.Fatalf("%s not sent", method)
		}
	}
}

// DrainSent takes the reports waiting on sent, without blocking.
func DrainSent(sent chan string) {
	for len(sent) > 0 {
		<-sent
	}
}

// PeerRig starts a 3-member cluster whose members can be cut off from their
// peers (etcdtest's PeerProxies), stopped in t's cleanup, and returns it,
// once its members serve, with a follower f (a member that does not lead)
// and another member u. It skips t in -short.
func PeerRig(t testing.TB) (c *etcdtest.Cluster, f, u *etcdtest.Member) {
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

// CaughtUp blocks until member m has applied revision rev, polling; it
// fails t after Timeout.
func CaughtUp(t testing.TB, m *etcdtest.Member, rev int64) {
	t.Helper()
	deadline := time.Now().Add(Timeout)
	for m.Rev() < rev {
		require.True(t, time.Now().Before(deadline), "%s did not reach revision %d", m.Name, rev)
		time.Sleep(10 * time.Millisecond) // polling the member's applied revision
	}
}

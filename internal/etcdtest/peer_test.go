package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// eventually polls cond every few milliseconds until it holds or d passes.
func eventually(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("%s: not within %v", what, d)
		}
		<-tick.C
	}
	return time.Since(start)
}

// leaderAndFollower waits for a leader and returns it with a follower.
func leaderAndFollower(t *testing.T, c *Cluster) (leader, follower *Member) {
	t.Helper()
	eventually(t, 10*time.Second, "leader", func() bool {
		leader, follower = c.Leader(), c.Follower()
		return leader != nil && follower != nil
	})
	return leader, follower
}

// A follower cut off from its peers stops applying what the leader commits
// but keeps serving serializable reads from its stale state; healed, it
// catches up from the held traffic.
func TestCutPeersFollowerLags(t *testing.T) { // not parallel: it looks for the relay goroutines of the process
	c := Start(t, Options{Members: 3, PeerProxies: true})
	leader, f := leaderAndFollower(t, c)
	lcli := NewClient(t, []string{leader.Endpoint()})
	fcli := NewClient(t, []string{f.Endpoint()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	resp, err := lcli.Put(ctx, "k", "old")
	if err != nil {
		t.Fatal(err)
	}
	old := resp.Header.Revision
	eventually(t, 10*time.Second, "follower applies the first put", func() bool { return f.Rev() >= old })

	if err := c.CutPeers(f); err != nil {
		t.Fatal(err)
	}
	cutAt := time.Now()
	var rev int64
	for i := range 3 {
		resp, err := lcli.Put(ctx, "k", fmt.Sprint("new", i))
		if err != nil {
			t.Fatal(err)
		}
		rev = resp.Header.Revision
	}
	putsTook := time.Since(cutAt)
	// The follower must not see them while cut: watch it for a while.
	for until := time.Now().Add(100 * time.Millisecond); time.Now().Before(until); time.Sleep(5 * time.Millisecond) {
		if got := f.Rev(); got >= rev {
			t.Fatalf("cut follower applied revision %d (leader at %d)", got, rev)
		}
	}
	if lr := leader.Rev(); lr < rev {
		t.Fatalf("leader at revision %d, want >= %d", lr, rev)
	}
	get, err := fcli.Get(ctx, "k", clientv3.WithSerializable())
	if err != nil {
		t.Fatal(err)
	}
	if len(get.Kvs) != 1 || string(get.Kvs[0].Value) != "old" {
		t.Fatalf("serializable get from the cut follower: %v, want k=old", get.Kvs)
	}
	lagRev := f.Rev()
	if err := c.HealPeers(f); err != nil {
		t.Fatal(err)
	}
	cutFor := time.Since(cutAt)
	catchUp := eventually(t, 10*time.Second, "healed follower catches up", func() bool { return f.Rev() >= rev })
	t.Logf("cut %v (puts %v); follower at rev %d while leader at %d; caught up %v after heal",
		cutFor.Round(time.Millisecond), putsTook.Round(time.Millisecond), lagRev, rev, catchUp.Round(time.Millisecond))
	if cutFor > 500*time.Millisecond {
		t.Logf("cut outlasted the election timeout (slow machine); the follower may have looked for a new leader")
	}

	get, err = fcli.Get(ctx, "k", clientv3.WithSerializable())
	if err != nil {
		t.Fatal(err)
	}
	if len(get.Kvs) != 1 || string(get.Kvs[0].Value) != "new2" {
		t.Fatalf("serializable get from the healed follower: %v, want k=new2", get.Kvs)
	}

	// Close joins every peer proxy goroutine.
	buf := make([]byte, 1<<20)
	if !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "etcdtest.(*relay)") {
		t.Fatal("no relay goroutines while running")
	}
	c.Close()
	// A goroutine Close joined may still be on its way out (its deferred
	// wg.Done has run): it must be gone soon, and one that is not was
	// never joined.
	eventually(t, 2*time.Second, "relay goroutines gone after Close", func() bool {
		return !strings.Contains(string(buf[:runtime.Stack(buf, true)]), "etcdtest.(*relay)")
	})
}

// A proposal a cut-off follower forwards to the leader waits in the network
// (it is on the follower's message stream, which the cut holds) and is
// applied once the partition heals, long after its client gave up.
func TestCutPeersForwardedProposalAppliedLate(t *testing.T) {
	t.Parallel()
	c := Start(t, Options{Members: 3, PeerProxies: true})
	leader, f := leaderAndFollower(t, c)
	lcli := NewClient(t, []string{leader.Endpoint()})
	fcli := NewClient(t, []string{f.Endpoint()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Warm the follower's client connection and forwarding path.
	if _, err := fcli.Put(ctx, "warm", "x"); err != nil {
		t.Fatal(err)
	}

	if err := c.CutPeers(f); err != nil {
		t.Fatal(err)
	}
	cutAt := time.Now()
	pctx, pcancel := context.WithTimeout(ctx, time.Second)
	_, putErr := fcli.Put(pctx, "late", "v")
	pcancel()
	if putErr == nil {
		t.Fatal("put through the cut follower succeeded")
	}
	// Either the client's deadline fires first, or the follower's copy of it
	// (gRPC propagates deadlines) and the server reports its own timeout.
	switch {
	case errors.Is(putErr, context.DeadlineExceeded), status.Code(putErr) == codes.DeadlineExceeded:
	case errors.Is(putErr, rpctypes.ErrTimeout), errors.Is(putErr, rpctypes.ErrTimeoutDueToConnectionLost):
	default:
		t.Fatalf("put through the cut follower: %v, want a deadline or timeout error", putErr)
	}
	putErrAfter := time.Since(cutAt)
	get, err := lcli.Get(ctx, "late")
	if err != nil {
		t.Fatal(err)
	}
	if len(get.Kvs) != 0 {
		t.Fatalf("key applied while the follower was cut: %v", get.Kvs)
	}
	if err := c.HealPeers(f); err != nil {
		t.Fatal(err)
	}
	cutFor := time.Since(cutAt)
	var createRev int64
	applied := eventually(t, 10*time.Second, "late proposal applied", func() bool {
		get, err := lcli.Get(ctx, "late")
		if err != nil {
			t.Fatal(err)
		}
		if len(get.Kvs) == 1 {
			createRev = get.Kvs[0].CreateRevision
			return true
		}
		return false
	})
	t.Logf("put failed after %v (%v); cut %v; key applied at rev %d, %v after heal",
		putErrAfter.Round(time.Millisecond), putErr, cutFor.Round(time.Millisecond), createRev, applied.Round(time.Millisecond))
}

func TestCutPeersNeedsPeerProxies(t *testing.T) {
	t.Parallel()
	c := Start(t, Options{})
	if err := c.CutPeers(c.Member(0)); err == nil {
		t.Fatal("CutPeers without PeerProxies succeeded")
	}
	if err := c.HealPeers(c.Member(0)); err == nil {
		t.Fatal("HealPeers without PeerProxies succeeded")
	}
	if c.Member(0).ID() == 0 || c.Member(0).Rev() == 0 {
		t.Fatalf("member ID %x, revision %d: want both set", c.Member(0).ID(), c.Member(0).Rev())
	}
}

// A restarted member keeps its peer proxy and ID, and the cut still works.
func TestCutPeersAcrossRestart(t *testing.T) {
	t.Parallel()
	c := Start(t, Options{Members: 3, PeerProxies: true})
	leader, f := leaderAndFollower(t, c)
	id := f.ID()
	c.Stop(f)
	if err := c.Restart(f); err != nil {
		t.Fatal(err)
	}
	if f.ID() != id {
		t.Fatalf("restarted member ID %x, was %x", f.ID(), id)
	}
	lcli := NewClient(t, []string{leader.Endpoint()})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := lcli.Put(ctx, "k", "v")
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "restarted member catches up", func() bool { return f.Rev() >= resp.Header.Revision })

	// Its new connections are recognised and cut too.
	if err := c.CutPeers(f); err != nil {
		t.Fatal(err)
	}
	resp, err = lcli.Put(ctx, "k", "w")
	if err != nil {
		t.Fatal(err)
	}
	for until := time.Now().Add(100 * time.Millisecond); time.Now().Before(until); time.Sleep(5 * time.Millisecond) {
		if got := f.Rev(); got >= resp.Header.Revision {
			t.Fatalf("cut restarted member applied revision %d", got)
		}
	}
	if err := c.HealPeers(f); err != nil {
		t.Fatal(err)
	}
	eventually(t, 10*time.Second, "healed member catches up", func() bool { return f.Rev() >= resp.Header.Revision })
}

// The relay learns a connection's sender from X-Server-From even when the
// first request on the keep-alive connection (a probe) did not carry it,
// and holds that sender's traffic while stalled, delivering it on heal.
func TestRelaySniffsSenderAfterProbe(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	var mu sync.Mutex
	var got []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = append(got, r.URL.Path+" "+r.Header.Get("X-Server-From")+" "+string(body))
		mu.Unlock()
	}))
	defer srv.Close()

	var smu sync.Mutex
	stalledFrom := uint64(0x2a)
	stalling := true
	r, err := newRelay(strings.TrimPrefix(srv.URL, "http://"), true, func(from uint64) bool {
		smu.Lock()
		defer smu.Unlock()
		return stalling && from == stalledFrom
	})
	if err != nil {
		t.Fatal(err)
	}
	defer r.close()

	tr := &http.Transport{MaxConnsPerHost: 1}
	defer tr.CloseIdleConnections()
	cli := &http.Client{Transport: tr}
	var conns atomic.Int32
	dial := func(req *http.Request) *http.Request {
		return req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			GotConn: func(info httptrace.GotConnInfo) {
				if !info.Reused {
					conns.Add(1)
				}
			},
		}))
	}
	base := "http://" + r.addr()

	// A probe with a body and no sender flows.
	req, _ := http.NewRequest(http.MethodPost, base+"/probe", strings.NewReader("ping"))
	resp, err := cli.Do(dial(req))
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	// The sender's request on the same connection is held.
	done := make(chan error, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodPost, base+"/raft", strings.NewReader("msg"))
		req.Header.Set("X-Server-From", "2a")
		resp, err := cli.Do(dial(req))
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		done <- err
	}()
	select {
	case err := <-done:
		t.Fatalf("stalled sender's request completed: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	smu.Lock()
	stalling = false
	smu.Unlock()
	r.notify()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("healed request not delivered within 10s")
	}
	mu.Lock()
	defer mu.Unlock()
	want := []string{"/probe  ping", "/raft 2a msg"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("server got %q, want %q", got, want)
	}
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections, want 1 (keep-alive)", n)
	}
}

// The client Proxy stalls both directions while blackholed and delivers
// the held bytes in order once healed; Close joins its goroutines.
func TestProxyBlackholeHoldsBytes(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	echoed := make(chan struct{})
	go func() {
		defer close(echoed)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		io.Copy(c, c)
	}()
	p := NewProxy(t, ln.Addr().String())
	defer p.Close()
	c, err := net.Dial("tcp", strings.TrimPrefix(p.Endpoint(), "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p.Blackhole(true)
	for _, s := range []string{"one ", "two ", "three"} {
		if _, err := c.Write([]byte(s)); err != nil {
			t.Fatal(err)
		}
	}
	c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("read %d bytes through a blackholed proxy (%v)", n, err)
	}
	p.Blackhole(false)
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, len("one two three"))
	if _, err := io.ReadFull(c, got); err != nil {
		t.Fatal(err)
	}
	if string(got) != "one two three" {
		t.Fatalf("echo %q", got)
	}
	p.Close()
	select {
	case <-echoed:
	case <-time.After(10 * time.Second):
		t.Fatal("proxy close did not close the target connection")
	}
}

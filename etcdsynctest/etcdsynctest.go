// Package etcdsynctest runs a real etcd inside your tests, on 127.0.0.1 and
// random ports, with the faults you need to test what your code does when a
// lock goes away under it: members that stop and restart, and a client link
// that can be cut (as a network partition does), healed and slowed.
//
// Start gives a client of one embedded member. StartCluster gives a cluster
// of n members: clients of all of them (Client), a client whose link can be
// cut (ClientThrough), and each member (Member, Leader) to stop and restart.
// Everything a call starts is stopped by the test's Cleanup, in reverse
// order (clients first). Programs and examples, which have no testing.TB,
// use Connect or StartServer.
//
// A service that must stop working the moment it loses its lock is tested by
// cutting its link for longer than its session's TTL. The service here holds
// a Mutex while it works and stops when the hold's Done channel closes:
//
//	func TestReporterStopsWhenItLosesTheLock(t *testing.T) {
//		t.Parallel() // each test has a cluster of its own
//		c := etcdsynctest.StartCluster(t, 1)
//		cli, link := c.ClientThrough(t)
//		s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(time.Second))
//		if err != nil {
//			t.Fatal(err)
//		}
//		t.Cleanup(func() { s.Close() })
//		r := &reporter{mutex: etcdsync.NewMutex(s, "jobs/report")}
//		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
//		defer cancel()
//		stopped := make(chan error, 1)
//		go func() { stopped <- r.Run(ctx) }()
//		waitFor(t, r.working) // it holds the lock and writes reports
//
//		link.Cut() // etcd no longer hears from it: its lease runs out
//		select {
//		case err := <-stopped:
//			if !errors.Is(err, errLockLost) {
//				t.Fatalf("Run returned %v, want errLockLost", err)
//			}
//		case <-time.After(10 * time.Second):
//			t.Fatal("still running 10s after its link was cut")
//		}
//		if r.working() {
//			t.Fatal("it says it still works after it stopped")
//		}
//	}
//
// The package's own example_user_test.go runs exactly this test, with the
// reporter it tests.
//
// The embedded server starts a few goroutines that live as long as the
// process (gRPC and opencensus internals): a test that checks for leaked
// goroutines (go.uber.org/goleak) ignores them with IgnoredGoroutines.
package etcdsynctest

import (
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Start starts one embedded etcd member on 127.0.0.1 and random ports, and
// returns a client of it. It blocks until the member serves (at most 30s)
// and fails tb if it does not. The client is closed and the member stopped
// (its data removed with tb's temporary directory) by tb.Cleanup.
// Call it from the test's goroutine.
func Start(tb testing.TB) *clientv3.Client {
	tb.Helper()
	return StartCluster(tb, 1).Client(tb)
}

// Cluster is a set of embedded etcd members started by StartCluster. Its
// methods are safe for concurrent use.
type Cluster struct {
	rig     *etcdtest.Cluster
	members []*Member
}

// Member is one member of a Cluster.
type Member struct {
	rig *etcdtest.Cluster
	m   *etcdtest.Member
}

// StartCluster starts a cluster of the given number of embedded etcd
// members on 127.0.0.1 and random ports. It blocks until every member
// serves (at most 30s each) and fails tb if one does not, or if members is
// less than 1. Every member is stopped by tb.Cleanup, after the clients
// made from the cluster are closed. Call it from the test's goroutine.
func StartCluster(tb testing.TB, members int) *Cluster {
	tb.Helper()
	if members < 1 {
		tb.Fatalf("etcdsynctest: StartCluster with %d members: need at least 1", members)
	}
	rig, err := etcdtest.StartCluster(tb.TempDir(), etcdtest.Options{Members: members})
	if err != nil {
		tb.Fatalf("etcdsynctest: %v", err)
	}
	tb.Cleanup(rig.Close)
	c := &Cluster{rig: rig}
	for _, m := range rig.Members() {
		c.members = append(c.members, &Member{rig: rig, m: m})
	}
	return c
}

// Endpoints returns every member's client URL (http://127.0.0.1:port).
func (c *Cluster) Endpoints() []string { return c.rig.Endpoints() }

// Client returns a client of every member, closed by tb.Cleanup. It does
// not wait for a connection: the first request does.
func (c *Cluster) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	return etcdtest.NewClient(tb, c.Endpoints())
}

// Member returns the i-th member, counting from 0. It panics when i is out
// of range, as an index does.
func (c *Cluster) Member(i int) *Member {
	if i < 0 || i >= len(c.members) {
		panic(fmt.Sprintf("etcdsynctest: Member(%d) of a %d-member cluster", i, len(c.members)))
	}
	return c.members[i]
}

// Leader returns the member that is the raft leader now, or nil when none is
// (an election is under way, or too few members run). It asks the members
// in this process, no RPC; it waits only for a Stop or Restart in progress.
func (c *Cluster) Leader() *Member {
	l := c.rig.Leader()
	for _, m := range c.members {
		if m.m == l {
			return m
		}
	}
	return nil
}

// Endpoint returns the member's client URL. It stays the same across
// Stop and Restart.
func (m *Member) Endpoint() string { return m.m.Endpoint() }

// Stop stops the member and blocks until it has stopped; its clients' open
// connections to it fail. Its data stays, for Restart. Stopping a stopped
// member does nothing.
func (m *Member) Stop() { m.rig.Stop(m.m) }

// Restart starts a stopped member again on its ports and data, and blocks
// until it serves (at most 30s); a running member is left as it is. An
// error (its port taken meanwhile, say) leaves it stopped. A member serves
// only once a majority of the cluster runs, itself included, and Restarts
// run one at a time: with a majority of the members stopped, Restart fails
// after 30s.
func (m *Member) Restart() error { return m.rig.Restart(m.m) }

// Link is the network path between a client made by ClientThrough and the
// cluster: a TCP proxy in front of each member. Its methods do not block and
// are safe for concurrent use.
type Link struct {
	proxies []*etcdtest.Proxy
}

// ClientThrough returns a client of every member whose connections go
// through a Link, and the Link. The client is closed, then the Link's
// proxies are stopped, by tb.Cleanup. The cluster's other clients do not
// go through the Link, so a test can still see etcd while the Link is cut.
func (c *Cluster) ClientThrough(tb testing.TB) (*clientv3.Client, *Link) {
	tb.Helper()
	l := &Link{}
	var endpoints []string
	for _, ep := range c.Endpoints() {
		u, err := url.Parse(ep)
		if err != nil {
			tb.Fatalf("etcdsynctest: member endpoint %q: %v", ep, err)
		}
		p := etcdtest.NewProxy(tb, u.Host)
		l.proxies = append(l.proxies, p)
		endpoints = append(endpoints, p.Endpoint())
	}
	return etcdtest.NewClient(tb, endpoints), l
}

// Cut stalls the Link in both directions, as a network partition does:
// connections stay open, new ones are accepted, and nothing gets through.
// Bytes sent meanwhile are held, not dropped, and delivered in order by Heal
// (TCP would retransmit them). Requests through the Link block until their
// contexts end; a Session behind it ends when its TTL runs out.
func (l *Link) Cut() {
	for _, p := range l.proxies {
		p.Blackhole(true)
	}
}

// Heal ends a Cut: held bytes flow, then new ones.
func (l *Link) Heal() {
	for _, p := range l.proxies {
		p.Blackhole(false)
	}
}

// SetLatency delays every reply (etcd to the client) by d from when it
// reached the Link, keeping order and spacing, as a slow link does;
// requests are not delayed. 0 ends the delay for replies that arrive from
// then on.
func (l *Link) SetLatency(d time.Duration) {
	for _, p := range l.proxies {
		p.SetLatency(d)
	}
}

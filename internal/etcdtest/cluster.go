// Package etcdtest runs real embedded etcd members on 127.0.0.1 for tests
// and benchmarks: a single member or a 3-member cluster, with member
// stop/restart, a TCP proxy that can blackhole a client, optional peer
// proxies that cut one member off from the others' raft traffic while its
// client port keeps serving, and TLS. The public etcdsynctest package is a
// thin layer over it for users' tests, programs and examples.
package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/crypto/bcrypt"

	"go.etcd.io/etcd/client/pkg/v3/types"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.etcd.io/etcd/server/v3/etcdserver"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// TB is the part of testing.TB the rig uses.
type TB interface {
	Helper()
	Cleanup(func())
	Fatalf(format string, args ...any)
	TempDir() string
}

// Options tune a cluster.
type Options struct {
	Members int    // 1 when zero
	Fsync   bool   // keep fsync on (benchmarks); off by default for speed
	TLS     *Certs // serve clients over TLS with these certificates

	// PeerProxies puts a proxy in front of every member's peer listener and
	// advertises it, so all raft traffic between members goes through the
	// proxies and Cluster.CutPeers can stall it. The proxies live as long
	// as the cluster; a restarted member keeps its proxy and ports.
	PeerProxies bool

	// MaxTxnOps is the members' --max-txn-ops (0: etcd's default, 128).
	MaxTxnOps uint
}

// Cluster is a set of embedded etcd members.
type Cluster struct {
	opts    Options
	mu      sync.Mutex
	members []*Member
	closed  bool

	peerMu sync.Mutex         // guards cut; never held while calling etcd
	cut    map[*Member]uint64 // members cut off from their peers, with their IDs
}

// Member is one embedded etcd server.
type Member struct {
	Name      string
	dir       string
	client    url.URL
	peer      url.URL // the member listens here
	ports     []int   // of client and peer, given by freePorts
	advertise url.URL // and peers reach it here: peer, or its peer proxy
	proxy     *relay  // the peer proxy, with Options.PeerProxies
	initial   string
	fsync     bool
	maxTxnOps uint
	tls       *Certs
	etcd      *embed.Etcd
	restarted bool
	id        atomic.Uint64 // etcd's member ID, known once started
}

// Start starts a cluster and stops it in tb's cleanup.
func Start(tb TB, opts Options) *Cluster {
	tb.Helper()
	c, err := StartCluster(tb.TempDir(), opts)
	if err != nil {
		tb.Fatalf("etcdtest: %v", err)
	}
	tb.Cleanup(c.Close)
	return c
}

// StartCluster starts a cluster with its data under dir. The caller must Close it.
// A port taken between its choice and the member's bind (by another test
// process) makes it start again on other ports, a few times.
func StartCluster(dir string, opts Options) (*Cluster, error) {
	for try := 0; ; try++ {
		c, err := startCluster(fmt.Sprintf("%s/%d", dir, try), opts)
		if err == nil || !errors.Is(err, syscall.EADDRINUSE) || try == 4 {
			return c, err
		}
	}
}

func startCluster(dir string, opts Options) (*Cluster, error) {
	if opts.Members == 0 {
		opts.Members = 1
	}
	c := &Cluster{opts: opts, cut: make(map[*Member]uint64)}
	var initial []string
	for i := 0; i < opts.Members; i++ {
		ports, err := freePorts(2)
		if err != nil {
			c.Close()
			return nil, err
		}
		m := &Member{
			Name:      fmt.Sprintf("m%d", i),
			dir:       fmt.Sprintf("%s/m%d", dir, i),
			client:    url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[0])},
			peer:      url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[1])},
			ports:     ports,
			fsync:     opts.Fsync,
			tls:       opts.TLS,
			maxTxnOps: opts.MaxTxnOps,
		}
		if m.tls != nil {
			m.client.Scheme = "https"
		}
		m.advertise = m.peer
		c.members = append(c.members, m)
		if opts.PeerProxies {
			m.proxy, err = newRelay(m.peer.Host, true, c.peerStalled(m))
			if err != nil {
				c.Close()
				return nil, err
			}
			m.advertise.Host = m.proxy.addr()
		}
		initial = append(initial, m.Name+"="+m.advertise.String())
	}
	errs := make(chan error, len(c.members))
	for _, m := range c.members {
		m.initial = strings.Join(initial, ",")
		go func() { errs <- m.start() }()
	}
	var first error
	for range c.members {
		if err := <-errs; err != nil && first == nil {
			first = err
		}
	}
	if first != nil {
		c.Close()
		return nil, first
	}
	return c, nil
}

// freePorts returns n ports on 127.0.0.1 that are free now, and reserves
// them (givenPorts). It skips the ports that a member of this process or of
// another test process on the machine has, or had until less than
// reuseAfter ago (a stopped member keeps its ports for its restart until
// its cluster closes: Cluster.Close). They are taken below the
// kernel's ephemeral range (32768 and up on Linux), so that the listeners
// that bind port 0 meanwhile (proxies, clients, other test processes)
// cannot take one before the member binds it.
func freePorts(n int) ([]int, error) {
	var ports []int
	var lns []net.Listener
	defer func() {
		for _, ln := range lns {
			ln.Close()
		}
	}()
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			givenPorts.release(ports...)
			return nil, fmt.Errorf("no free port below 32768 after %d tries", tries)
		}
		port := 10000 + rand.IntN(22000)
		ok, err := givenPorts.give(port)
		if err != nil {
			givenPorts.release(ports...)
			return nil, fmt.Errorf("reserve port %d: %w", port, err)
		}
		if !ok {
			continue // reserved, by this process or another
		}
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			givenPorts.release(port)
			continue // taken
		}
		lns = append(lns, ln)
		ports = append(ports, port)
	}
	return ports, nil
}

// reuseAfter is how long a port stays reserved after its cluster closed. A
// test may check that nothing listens on its cluster's ports any more once
// the cluster closed (etcdsynctest's TestEverythingStoppedAtTheEnd does, in
// the parent test after the subtest's cleanup closed it): it must not find
// there a member that a test of this process or of another one started
// meanwhile.
const reuseAfter = time.Minute

// givenPorts are the ports freePorts gave to members of this process, until
// reuseAfter after their clusters closed. Each is also locked against the
// other processes on the machine (lockPort), so two test binaries run at
// once never give out the same port.
var givenPorts = portSet{ports: make(map[int]time.Time)}

type portSet struct {
	mu    sync.Mutex
	ports map[int]time.Time // zero while given, else when it was released
}

// give reserves port, unless this process or another has it reserved; it
// first ends the reservations that outlived reuseAfter.
func (ps *portSet) give(port int) (bool, error) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	for p, released := range ps.ports {
		if !released.IsZero() && time.Since(released) > reuseAfter {
			if err := unlockPort(p); err != nil {
				return false, err
			}
			delete(ps.ports, p)
		}
	}
	if _, ok := ps.ports[port]; ok {
		return false, nil
	}
	ok, err := lockPort(port)
	if err != nil || !ok {
		return false, err
	}
	ps.ports[port] = time.Time{}
	return true, nil
}

// release ends the members' use of ports; they stay reserved for reuseAfter.
func (ps *portSet) release(ports ...int) {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	now := time.Now()
	for _, port := range ports {
		ps.ports[port] = now
	}
}

func (m *Member) start() error {
	cfg := embed.NewConfig()
	cfg.Name = m.Name
	cfg.Dir = m.dir
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{m.client}, []url.URL{m.client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{m.peer}, []url.URL{m.advertise}
	cfg.InitialCluster = m.initial
	cfg.InitialClusterToken = "etcdsync-test"
	cfg.ClusterState = embed.ClusterStateFlagNew
	if m.restarted {
		cfg.ClusterState = embed.ClusterStateFlagExisting
	}
	cfg.TickMs, cfg.ElectionMs = 50, 500
	cfg.UnsafeNoFsync = !m.fsync
	if m.maxTxnOps > 0 {
		cfg.MaxTxnOps = m.maxTxnOps
	}
	cfg.BcryptCost = uint(bcrypt.MinCost) // password checks in milliseconds, also under -race (seconds at the default cost)
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	cfg.LogLevel = "fatal"
	cfg.ListenMetricsUrls = nil
	if m.tls != nil {
		cfg.ClientTLSInfo.CertFile, cfg.ClientTLSInfo.KeyFile = m.tls.CertFile, m.tls.KeyFile
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return fmt.Errorf("start %s: %w", m.Name, err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return fmt.Errorf("start %s: %w", m.Name, err)
	case <-time.After(30 * time.Second):
		e.Close()
		return fmt.Errorf("start %s: not ready within 30s", m.Name)
	}
	m.etcd = e
	m.id.Store(memberID(e.Server))
	return nil
}

// memberID returns the server's member ID. etcd's server names the method
// ID in 3.5 and MemberID from 3.6 on; the test kit builds with each client
// line (.ci/clientline.sh), so it asks for whichever the server has.
func memberID(srv *etcdserver.EtcdServer) uint64 {
	switch s := any(srv).(type) {
	case interface{ MemberID() types.ID }:
		return uint64(s.MemberID())
	case interface{ ID() types.ID }:
		return uint64(s.ID())
	}
	panic("etcdtest: etcd's server has neither MemberID nor ID")
}

// Endpoint returns the member's client URL.
func (m *Member) Endpoint() string { return m.client.String() }

// Server returns the running member's server (for an in-process client,
// v3client.New), or nil when it is stopped.
func (m *Member) Server() *etcdserver.EtcdServer {
	if m.etcd == nil {
		return nil
	}
	return m.etcd.Server
}

// Running reports whether the member is running.
func (m *Member) Running() bool { return m.etcd != nil }

// IsLeader reports whether the running member is the raft leader.
func (m *Member) IsLeader() bool {
	return m.etcd != nil && uint64(m.etcd.Server.Leader()) == memberID(m.etcd.Server)
}

// ID returns the member's etcd member ID (0 before its first start). IDs
// derive from the advertised peer URLs, so a restart keeps them.
func (m *Member) ID() uint64 { return m.id.Load() }

// Rev returns the revision of the member's applied key-value state, 0 when
// it is stopped. A follower cut off from its peers stays behind the leader.
func (m *Member) Rev() int64 {
	if m.etcd == nil {
		return 0
	}
	return m.etcd.Server.KV().Rev()
}

// Members returns the cluster's members.
func (c *Cluster) Members() []*Member { return c.members }

// Member returns the i-th member.
func (c *Cluster) Member(i int) *Member { return c.members[i] }

// Endpoints returns every member's client URL.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, m := range c.members {
		eps = append(eps, m.Endpoint())
	}
	return eps
}

// Leader returns the running member that is the raft leader, or nil.
func (c *Cluster) Leader() *Member {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range c.members {
		if m.IsLeader() {
			return m
		}
	}
	return nil
}

// Stop stops a member; its data stays for Restart.
func (c *Cluster) Stop(m *Member) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m.etcd != nil {
		m.etcd.Close()
		m.etcd = nil
	}
}

// Restart starts a stopped member again on the same ports and data.
func (c *Cluster) Restart(m *Member) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || m.etcd != nil {
		return nil
	}
	m.restarted = true
	return m.start()
}

// Close stops every member and removes no data (tests' temp dirs do that).
// It heals cut peers first, so a leader can hand over leadership on the way.
func (c *Cluster) Close() {
	c.peerMu.Lock()
	clear(c.cut)
	c.peerMu.Unlock()
	c.notifyPeerProxies()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	for _, m := range c.members {
		if m.etcd != nil {
			m.etcd.Close()
			m.etcd = nil
		}
	}
	for _, m := range c.members {
		if m.proxy != nil {
			m.proxy.close()
		}
		givenPorts.release(m.ports...)
	}
}

// ClientConfig returns a client config for endpoints, quiet and with extra
// dial options (interceptors, for counting RPCs).
func ClientConfig(endpoints []string, dial ...grpc.DialOption) clientv3.Config {
	return clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: dial,
	}
}

// Client returns a client of every member, closed in tb's cleanup.
func (c *Cluster) Client(tb TB, dial ...grpc.DialOption) *clientv3.Client {
	tb.Helper()
	return NewClient(tb, c.Endpoints(), dial...)
}

// Conn returns a gRPC connection of its own to endpoint (a plain http://
// member or proxy), for a test that routes calls to one member or calls a
// server API the client has no interface for; closed in tb's cleanup. It
// does not block: it connects on first use.
func Conn(tb TB, endpoint string) *grpc.ClientConn {
	tb.Helper()
	conn, err := grpc.NewClient(strings.TrimPrefix(endpoint, "http://"), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatalf("etcdtest: connection to %s: %v", endpoint, err)
	}
	tb.Cleanup(func() { conn.Close() })
	return conn
}

// NewClient returns a client of endpoints, closed in tb's cleanup.
func NewClient(tb TB, endpoints []string, dial ...grpc.DialOption) *clientv3.Client {
	tb.Helper()
	cli, err := clientv3.New(ClientConfig(endpoints, dial...))
	if err != nil {
		tb.Fatalf("etcdtest: client: %v", err)
	}
	tb.Cleanup(func() { cli.Close() })
	return cli
}

// TransferLeader moves raft leadership from the current leader to another
// running member.
func (c *Cluster) TransferLeader(ctx context.Context) error {
	leader := c.Leader()
	if leader == nil {
		return fmt.Errorf("no leader")
	}
	c.mu.Lock()
	var to *Member
	for _, m := range c.members {
		if m != leader && m.etcd != nil {
			to = m
			break
		}
	}
	c.mu.Unlock()
	if to == nil {
		return fmt.Errorf("no other running member")
	}
	srv := leader.etcd.Server
	return srv.MoveLeader(ctx, memberID(srv), memberID(to.etcd.Server))
}

// Follower returns a running member that is not the leader, or nil.
func (c *Cluster) Follower() *Member {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, m := range c.members {
		if m.etcd != nil && !m.IsLeader() {
			return m
		}
	}
	return nil
}

// CutPeers cuts m off from its peers: every raft connection between m and
// another member stalls in both directions, as in a network partition. The
// connections stay open and nothing is dropped; what was sent is held and
// delivered in order by HealPeers. That covers every connection through m's
// own peer proxy (whoever the sender) and, in the other members' proxies,
// every connection m opened; connections opened while cut stall too. m's
// client port keeps serving, from m's possibly stale state.
//
// In etcd v3.7.3 rafthttp's 5s stream read/write timeouts are not applied
// (NewTimeoutTransport sets http.Transport.Dial, which its DialContext
// overrides), so a stalled stream stays up however long the cut lasts and
// delivers its backlog on heal. A cut longer than the election timeout
// (500ms here) makes m a pre-candidate without a leader: proposals its
// clients make from then on block in raft until their context ends and are
// never sent. Pre-vote and check-quorum keep the rest of the cluster's
// leader in place. CutPeers needs Options.PeerProxies.
func (c *Cluster) CutPeers(m *Member) error {
	return c.setCut(m, true)
}

// HealPeers ends CutPeers(m): held traffic is delivered in order and flows again.
func (c *Cluster) HealPeers(m *Member) error {
	return c.setCut(m, false)
}

func (c *Cluster) setCut(m *Member, cut bool) error {
	if !c.opts.PeerProxies {
		return fmt.Errorf("etcdtest: cutting peers needs Options.PeerProxies")
	}
	if m == nil || !slices.Contains(c.members, m) {
		return fmt.Errorf("etcdtest: not a member of this cluster")
	}
	id := m.ID()
	if id == 0 {
		return fmt.Errorf("etcdtest: %s has no member ID yet", m.Name)
	}
	c.peerMu.Lock()
	if cut {
		c.cut[m] = id
	} else {
		delete(c.cut, m)
	}
	c.peerMu.Unlock()
	c.notifyPeerProxies()
	return nil
}

// peerStalled is the policy of owner's peer proxy: everything stalls while
// owner is cut; otherwise a connection stalls while its sender is cut, and
// one from an unknown sender flows.
func (c *Cluster) peerStalled(owner *Member) func(from uint64) bool {
	return func(from uint64) bool {
		c.peerMu.Lock()
		defer c.peerMu.Unlock()
		if _, ok := c.cut[owner]; ok {
			return true
		}
		for _, id := range c.cut {
			if from != 0 && from == id {
				return true
			}
		}
		return false
	}
}

func (c *Cluster) notifyPeerProxies() {
	for _, m := range c.members {
		if m.proxy != nil {
			m.proxy.notify()
		}
	}
}

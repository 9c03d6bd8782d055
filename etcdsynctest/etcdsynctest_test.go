package etcdsynctest_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"runtime"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// testTimeout bounds every wait of a test.
const testTimeout = 20 * time.Second

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	t.Cleanup(cancel)
	return ctx
}

// host returns the host:port of a client URL on 127.0.0.1.
func host(t *testing.T, endpoint string) string {
	t.Helper()
	u, err := url.Parse(endpoint)
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", u.Hostname(), endpoint)
	return u.Host
}

// requireClosed fails t if something still accepts connections at endpoint.
func requireClosed(t *testing.T, endpoint string) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", host(t, endpoint), time.Second)
	if err == nil {
		conn.Close()
		t.Fatalf("%s still accepts connections", endpoint)
	}
}

// client returns a client of endpoints only, closed in t's cleanup.
func client(t *testing.T, endpoints ...string) *clientv3.Client {
	t.Helper()
	cli, err := clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	return cli
}

// put writes key=val through cli within d.
func put(cli *clientv3.Client, key, val string, d time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	_, err := cli.Put(ctx, key, val)
	return err
}

// get reads key through cli ("" when absent) within testTimeout.
func get(t *testing.T, cli *clientv3.Client, key string) string {
	t.Helper()
	resp, err := cli.Get(ctxT(t), key)
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return ""
	}
	return string(resp.Kvs[0].Value)
}

// Start serves on 127.0.0.1; when the test ends its client is closed and
// nothing listens there any more.
func TestStart(t *testing.T) {
	t.Parallel()
	var cli *clientv3.Client
	t.Run("test", func(t *testing.T) {
		cli = etcdsynctest.Start(t)
		require.Len(t, cli.Endpoints(), 1)
		host(t, cli.Endpoints()[0])
		require.NoError(t, put(cli, "k", "v", testTimeout))
		require.Equal(t, "v", get(t, cli, "k"))
	})
	require.Error(t, cli.Ctx().Err(), "client still open after the test")
	requireClosed(t, cli.Endpoints()[0])
}

// Every member, client and link proxy StartCluster and ClientThrough made is
// closed when the test ends.
func TestEverythingStoppedAtTheEnd(t *testing.T) {
	t.Parallel()
	var members, links []string
	var clis []*clientv3.Client
	t.Run("test", func(t *testing.T) {
		c := etcdsynctest.StartCluster(t, 3)
		members = c.Endpoints()
		cli, _ := c.ClientThrough(t)
		links = cli.Endpoints()
		clis = append(clis, cli, c.Client(t))
		for _, cli := range clis {
			require.NoError(t, put(cli, "k", "v", testTimeout))
		}
	})
	require.Len(t, members, 3)
	require.Len(t, links, 3)
	for _, ep := range append(members, links...) {
		requireClosed(t, ep)
	}
	for _, cli := range clis {
		require.Error(t, cli.Ctx().Err(), "client still open after the test")
	}
}

// fatalTB records Fatalf and ends the goroutine, as testing.T does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func TestStartClusterBadInput(t *testing.T) {
	t.Parallel()
	for _, n := range []int{0, -1} {
		tb := &fatalTB{TB: t}
		done := make(chan struct{})
		go func() {
			defer close(done)
			etcdsynctest.StartCluster(tb, n)
			t.Errorf("StartCluster(%d) returned", n)
		}()
		<-done
		require.Equal(t, fmt.Sprintf("etcdsynctest: StartCluster with %d members: need at least 1", n), tb.msg)
	}
	c := etcdsynctest.StartCluster(t, 1)
	require.PanicsWithValue(t, "etcdsynctest: Member(1) of a 1-member cluster", func() { c.Member(1) })
	require.PanicsWithValue(t, "etcdsynctest: Member(-1) of a 1-member cluster", func() { c.Member(-1) })
}

// A stopped member refuses, a restarted one serves its data again.
func TestMemberStopRestart(t *testing.T) {
	t.Parallel()
	c := etcdsynctest.StartCluster(t, 1)
	cli := c.Client(t)
	m := c.Member(0)
	require.Equal(t, c.Endpoints()[0], m.Endpoint())
	require.Same(t, m, c.Leader())
	require.NoError(t, put(cli, "k", "before", testTimeout))

	m.Stop()
	m.Stop() // a stopped member stays stopped
	require.Nil(t, c.Leader())
	requireClosed(t, m.Endpoint())
	require.Error(t, put(cli, "k", "while stopped", 300*time.Millisecond))

	require.NoError(t, m.Restart())
	require.NoError(t, m.Restart(), "restarting a running member")
	require.Equal(t, "before", get(t, cli, "k"))
}

// With the leader of three stopped the others go on; restarted, it catches up.
func TestClusterLeaderStopRestart(t *testing.T) {
	etcdtest.SkipClusterInShort(t, 3)
	t.Parallel()
	c := etcdsynctest.StartCluster(t, 3)
	eps := c.Endpoints()
	require.Len(t, eps, 3)
	for i, ep := range eps {
		host(t, ep)
		require.Equal(t, ep, c.Member(i).Endpoint())
	}
	cli := c.Client(t)
	leader := c.Leader()
	require.NotNil(t, leader)

	leader.Stop()
	require.NoError(t, put(cli, "k", "after the leader stopped", testTimeout))
	var next *etcdsynctest.Member
	waitFor(t, func() bool { next = c.Leader(); return next != nil })
	require.NotSame(t, leader, next)

	require.NoError(t, leader.Restart())
	require.Equal(t, "after the leader stopped", get(t, client(t, leader.Endpoint()), "k"))
}

// A cut link holds requests (the cluster's other clients go on); healed, it
// delivers them; slowed, replies come no sooner than the latency.
func TestLink(t *testing.T) {
	t.Parallel()
	for _, members := range []int{1, 3} {
		t.Run(fmt.Sprintf("members=%d", members), func(t *testing.T) {
			etcdtest.SkipClusterInShort(t, members)
			c := etcdsynctest.StartCluster(t, members)
			cli, link := c.ClientThrough(t)
			admin := c.Client(t)
			require.Len(t, cli.Endpoints(), members)
			for i, ep := range cli.Endpoints() {
				host(t, ep)
				require.NotEqual(t, c.Endpoints()[i], ep, "the client goes through the link")
			}
			require.NoError(t, put(cli, "k", "before", testTimeout))

			link.Cut()
			require.ErrorIs(t, put(cli, "k", "cut", 500*time.Millisecond), context.DeadlineExceeded)
			require.NoError(t, put(admin, "other", "goes on", testTimeout))
			held := make(chan error, 1)
			go func() { held <- put(cli, "held", "delivered", testTimeout) }()
			time.Sleep(300 * time.Millisecond)
			require.Equal(t, "", get(t, admin, "held"), "a write got through a cut link")

			link.Heal()
			select {
			case err := <-held:
				require.NoError(t, err)
			case <-time.After(testTimeout):
				t.Fatal("the held write did not complete after Heal")
			}
			require.Equal(t, "delivered", get(t, admin, "held"))

			link.SetLatency(300 * time.Millisecond)
			start := time.Now()
			require.Equal(t, "delivered", get(t, cli, "held"))
			require.GreaterOrEqual(t, time.Since(start), 300*time.Millisecond)
			link.SetLatency(0)
			require.Equal(t, "delivered", get(t, cli, "held"))
		})
	}
}

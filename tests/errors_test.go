package tests

// Error texts.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Error texts say what failed, on which name, and why, each once.
func TestErrorTextsSayWhatWhichAndWhyOnce(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "texts")
	require.NoError(t, m.Lock(ctx))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	closed, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	_, missing := etcdsync.NewSession(cli, etcdsync.WithLease(12345))

	own := m.TryLock(ctx)
	other := etcdsync.NewMutex(session(t, cli), "texts").TryLock(ctx)
	for _, tc := range []struct {
		err      error
		is       error
		contains []string
	}{
		{own, etcdsync.ErrLocked, []string{"held, or waited for, by this session"}},
		{other, etcdsync.ErrLocked, []string{m.Key(), fmt.Sprintf("create revision %d", m.Rev())}},
		{etcdsync.NewMutex(s, "texts2").Lock(cancelled), context.Canceled, []string{"acquire texts2:"}},
		{etcdsync.NewMutex(closed, "texts").Lock(ctx), etcdsync.ErrSessionClosed, []string{"session closed"}},
		{missing, etcdsync.ErrSessionExpired, []string{"lease 0x3039", "not found"}},
	} {
		require.ErrorIs(t, tc.err, tc.is)
		for _, want := range tc.contains {
			require.ErrorContains(t, tc.err, want)
		}
		require.Equal(t, 1, strings.Count(tc.err.Error(), "etcdsync:"), "prefix repeated: %v", tc.err)
		require.NotContains(t, tc.err.Error(), "texts/:", "a name shown with its slash")
		require.False(t, errors.Is(tc.err, etcdsync.ErrLocked) && strings.Contains(tc.err.Error(), "another holder") && tc.err == own)
	}
	require.NoError(t, m.Unlock(ctx))
}

// NewSession gives up when no answer comes within the client's DialTimeout
// (3 s when it has none), for endpoints that refuse connections and for
// endpoints that accept them and never answer alike, and its error names
// each endpoint and says which it did; a WithContext context that ends
// sooner bounds it too.
func TestNewSessionGivesUpWithinDialTimeout(t *testing.T) {
	t.Parallel()
	refused := deadAddr(t)
	silent := silentAddr(t)
	for _, tc := range []struct {
		name      string
		endpoints []string
		dial      time.Duration // the client's DialTimeout
		within    time.Duration // WithContext, 0: none
		want      time.Duration // when it gives up
		says      []string
	}{
		{"refused", []string{refused}, time.Second, 0, time.Second, []string{refused + ": connect: connection refused"}},
		{"silent", []string{silent}, time.Second, 0, time.Second, []string{silent + ": accepted a connection"}},
		{"both", []string{refused, silent}, 2 * time.Second, 0, 2 * time.Second, []string{refused + ": connect: connection refused", silent + ": accepted a connection"}},
		{"no DialTimeout", []string{silent}, 0, 0, 3 * time.Second, []string{"within 3s", silent + ": accepted a connection"}},
		{"WithContext sooner", []string{silent}, 5 * time.Second, 500 * time.Millisecond, 500 * time.Millisecond, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			cfg := etcdtest.ClientConfig(tc.endpoints)
			cfg.DialTimeout = tc.dial
			cli, err := clientv3.New(cfg)
			require.NoError(t, err)
			t.Cleanup(func() { cli.Close() })
			opts := []etcdsync.SessionOption{etcdsync.WithTTL(time.Minute)}
			if tc.within > 0 {
				ctx, cancel := context.WithTimeout(context.Background(), tc.within)
				defer cancel()
				opts = append(opts, etcdsync.WithContext(ctx))
			}
			began := time.Now()
			_, err = etcdsync.NewSession(cli, opts...)
			took := time.Since(began)
			t.Logf("%v after %v", err, took)
			require.ErrorIs(t, err, context.DeadlineExceeded)
			require.GreaterOrEqual(t, took, tc.want-100*time.Millisecond, "gave up before its bound")
			require.Less(t, took, tc.want+2*time.Second, "did not give up within its bound")
			for _, want := range tc.says {
				require.ErrorContains(t, err, want)
			}
		})
	}
}

// deadAddr returns an http:// address nobody listens on.
func deadAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// silentAddr returns an http:// address that accepts connections and never
// answers (a stopped server, a firewall that drops packets), until the test
// ends.
func silentAddr(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var conns []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns = append(conns, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range conns {
			c.Close()
		}
	})
	return "http://" + ln.Addr().String()
}

// On a closed client every call that takes the client, or a session on it,
// fails at once with an error wrapping ErrInvalidArgument and sends nothing
// (so etcd's client prints no retry warnings).
func TestClosedClientFailsAtOnceAndSendsNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	var cnt counter
	cli := c.Client(t, cnt.dial()...)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "closed/m")
	ctx := ctxT(t)
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, cli.Close())
	cnt.take()
	calls := []struct {
		what string
		call func() error
	}{
		{"NewSession", func() error { _, err := etcdsync.NewSession(cli); return err }},
		{"Mutex.Lock", func() error { return etcdsync.NewMutex(s, "closed/other").Lock(ctx) }},
		{"Mutex.TryLock", func() error { return etcdsync.NewMutex(s, "closed/other").TryLock(ctx) }},
		{"Mutex.Unlock", func() error { return m.Unlock(ctx) }},
		{"Mutex.Do", func() error { _, err := m.Do(ctx); return err }},
		{"Mutex.Check", m.Check},
		{"Election.Campaign", func() error { return etcdsync.NewElection(s, "closed/e").Campaign(ctx, "v") }},
		{"Election.Leader", func() error { _, err := etcdsync.NewElection(s, "closed/e").Leader(ctx); return err }},
		{"RWMutex.RLock", func() error { return etcdsync.NewRWMutex(s, "closed/rw").RLock(ctx) }},
		{"Semaphore.Acquire", func() error { return etcdsync.NewSemaphore(s, "closed/sem", 2).Acquire(ctx, 1) }},
		{"MultiLock.Lock", func() error { return etcdsync.NewMultiLock(s, "closed/a", "closed/b").Lock(ctx) }},
		{"Group.Join", func() error { return etcdsync.NewGroup(s, "closed/g").Join(ctx, "v") }},
		{"Group.Members", func() error { _, _, err := etcdsync.NewGroup(s, "closed/g").Members(ctx); return err }},
		{"GroupMembers", func() error { _, _, err := etcdsync.GroupMembers(ctx, cli, "closed/g"); return err }},
		{"WatchGroup", func() error { _, err := etcdsync.WatchGroup(ctx, cli, "closed/g"); return err }},
		{"DoubleBarrier.Enter", func() error { return etcdsync.NewDoubleBarrier(s, "closed/db", 2).Enter(ctx) }},
		{"Barrier.Hold", func() error { return etcdsync.NewBarrier(cli, "closed/b").Hold(ctx) }},
		{"Barrier.HoldFor", func() error { return etcdsync.NewBarrier(cli, "closed/b").HoldFor(ctx, s) }},
		{"Barrier.Release", func() error { return etcdsync.NewBarrier(cli, "closed/b").Release(ctx) }},
		{"Barrier.Wait", func() error { return etcdsync.NewBarrier(cli, "closed/b").Wait(ctx) }},
		{"Observer.Leader", func() error { _, err := etcdsync.NewObserver(cli, "closed/e").Leader(ctx); return err }},
		{"Holders", func() error { _, err := etcdsync.Holders(ctx, cli, "closed/m"); return err }},
	}
	for _, tc := range calls {
		began := time.Now()
		err := tc.call()
		took := time.Since(began)
		t.Logf("%s: %v in %v", tc.what, err, took)
		if !assert.ErrorIs(t, err, etcdsync.ErrInvalidArgument, tc.what) {
			continue
		}
		require.ErrorContains(t, err, "client closed", tc.what)
		require.Less(t, took, 100*time.Millisecond, tc.what)
		n, methods := cnt.take()
		require.Zero(t, n, "%s sent RPCs on a closed client: %v", tc.what, methods)
	}
	require.Equal(t, int64(0), cnt.streams.Load()-cnt.streams.Load())
}

// client.Close() racing Lock, Unlock and Run on a session of the client:
// every call returns within a bound (nil when it won the race, else an
// error wrapping ErrInvalidArgument or ErrSessionClosed), nothing panics or
// hangs, and Session.Err and Check report the close.
func TestClientCloseRacingCallsEndThem(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for i := range 12 { // each waits out its lease's TTL: side by side
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			t.Parallel()
			closeRace(t, c, admin, i)
		})
	}
}

// closeRace is round i of TestClientCloseRacingCallsEndThem: a Lock (i%3 ==
// 0), a Run (1) or an Unlock (2) raced by the client's close at a phase i
// sets.
func closeRace(t *testing.T, c *etcdtest.Cluster, admin *clientv3.Client, i int) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	cli, err := clientv3.New(etcdtest.ClientConfig(c.Endpoints()))
	require.NoError(t, err)
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(2*time.Second), etcdsync.WithSlack(0))
	require.NoError(t, err)
	name := fmt.Sprintf("closerace%d", i)
	m := etcdsync.NewMutex(s, name)
	if i%3 == 2 {
		require.NoError(t, m.Lock(ctx))
	}
	var got <-chan error
	switch i % 3 {
	case 0:
		got = async(func() error { return m.Lock(ctx) })
	case 1:
		got = async(func() error {
			return m.Run(ctx, func(ctx context.Context) error { <-ctx.Done(); return context.Cause(ctx) })
		})
	case 2:
		got = async(func() error { return m.Unlock(ctx) })
	}
	time.Sleep(time.Duration(i%8) * 250 * time.Microsecond) // the race's phase
	require.NoError(t, cli.Close())
	err = resultWithin(t, got, 5*time.Second, "the call racing the close")
	t.Logf("%d: %v", i, err)
	if err != nil && i%3 != 1 {
		require.True(t, errors.Is(err, etcdsync.ErrInvalidArgument) || errors.Is(err, etcdsync.ErrSessionClosed), "%d: %v", i, err)
	}
	if i%3 == 1 {
		require.Error(t, err, "Run returns when the client closes")
	}
	require.ErrorIs(t, s.Err(), etcdsync.ErrSessionClosed)
	require.Error(t, s.Check())
	closed := async(s.Close)
	resultWithin(t, closed, 2*time.Second, "Close")
	require.ErrorIs(t, m.Unlock(ctx), etcdsync.ErrInvalidArgument, "Unlock on a closed client")
	// What the close left behind is the lease's to clear: within its TTL.
	waitNoKeys(t, admin, name+"/")
}

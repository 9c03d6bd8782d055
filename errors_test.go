package etcdsync_test

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
	"github.com/stretchr/testify/require"
)

// NewSession against an endpoint nobody listens on names the endpoint and
// the dial error.
func TestNewSessionNamesUnreachableEndpoint(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nobody listens there now
	cli := etcdtest.NewClient(t, []string{"http://" + addr})
	_, err = etcdsync.NewSession(cli, etcdsync.WithTTL(time.Second))
	require.Error(t, err)
	require.ErrorContains(t, err, addr)
	require.ErrorContains(t, err, "connection refused")
}

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

// Without WithContext, NewSession gives up in seconds, not after the TTL,
// when no endpoint accepts a connection; with WithContext the context alone
// bounds it.
func TestNewSessionGivesUpOnUnreachableEndpoints(t *testing.T) {
	slow(t)
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	cli := etcdtest.NewClient(t, []string{"http://" + addr})
	done := async(func() error {
		_, err := etcdsync.NewSession(cli, etcdsync.WithTTL(time.Minute))
		return err
	})
	err = resultWithin(t, done, 30*time.Second, "NewSession with a 60 s TTL and no endpoint up")
	require.ErrorContains(t, err, "no endpoint accepted a connection")
	require.ErrorContains(t, err, addr)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	began := time.Now()
	_, err = etcdsync.NewSession(cli, etcdsync.WithContext(ctx))
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.GreaterOrEqual(t, time.Since(began), 4*time.Second, "WithContext's context bounds it, not the reachability check")
}

package tests

import (
	"context"
	"crypto/tls"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// secureCluster starts a member serving clients over TLS (certificates made
// here) with auth enabled: root, "rw" (read-write on locks/), "ro" (read on
// locks/) and "none" (no permission). It returns a client factory.
func secureCluster(t *testing.T) func(user string, dial ...grpc.DialOption) *clientv3.Client {
	certs, err := etcdtest.MakeCerts(t.TempDir())
	require.NoError(t, err)
	c := etcdtest.Start(t, etcdtest.Options{TLS: certs})
	connect := authClients(t, c.Endpoints(), certs.ClientTLS())
	etcdtest.EnableAuth(t, ctxT(t), connect(""), map[string]string{"root": "root", "rw": "locks-rw", "ro": "locks-ro", "none": ""})
	return connect
}

// authClients returns a factory of clients of endpoints (over TLS with
// tlsConfig, if non-nil) that log in as user (none if "") with its
// etcdtest.EnableAuth password; each is closed in t's cleanup.
func authClients(t *testing.T, endpoints []string, tlsConfig *tls.Config) func(user string, dial ...grpc.DialOption) *clientv3.Client {
	return func(user string, dial ...grpc.DialOption) *clientv3.Client {
		cfg := etcdtest.ClientConfig(endpoints, dial...)
		cfg.TLS = tlsConfig
		if user != "" {
			cfg.Username, cfg.Password = user, etcdtest.Password(user)
		}
		cli, err := clientv3.New(cfg)
		require.NoError(t, err)
		t.Cleanup(func() { cli.Close() })
		return cli
	}
}

func TestAuthAndTLS(t *testing.T) {
	t.Parallel()
	connect := secureCluster(t)
	ctx := ctxT(t)
	root, rw, ro, none := connect("root"), connect("rw"), connect("ro"), connect("none")

	// A read-write user locks, waits in the queue (the watch stream carries
	// its credentials), elects and releases.
	holder := heldMutex(t, ctx, rw, "locks/job")
	cnt := counter{created: make(chan struct{}, 4)}
	waiter := etcdsync.NewMutex(session(t, connect("rw", cnt.dial()...)), "locks/job")
	got := lockAsync(t, ctx, waiter)
	for i := 0; i < 2; i++ { // own key and predecessor watched, with credentials
		within(t, cnt.created, testTimeout, "waiter's watch created")
	}
	cnt.take()
	require.NoError(t, holder.Unlock(ctx))
	within(t, got, testTimeout, "rw waiter after the release")
	n, methods := cnt.take()
	require.Zero(t, n, "the handoff fell back to reads: %v", methods)
	e := etcdsync.NewElection(session(t, rw), "locks/elect")
	require.NoError(t, e.Campaign(ctx, "rw"))
	resp, err := e.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "rw", string(resp.Kvs[0].Value))

	// A read-only user gets a permission error and leaves no key.
	roSession := session(t, ro)
	require.ErrorIs(t, etcdsync.NewMutex(roSession, "locks/ro").Lock(ctx), rpctypes.ErrPermissionDenied)
	require.ErrorIs(t, etcdsync.NewElection(roSession, "locks/ro").Campaign(ctx, "x"), rpctypes.ErrPermissionDenied)
	require.Empty(t, keys(t, root, "locks/ro/"))

	// A user with no access can neither delete nor take over a hold.
	_, err = none.Delete(ctx, waiter.Key())
	require.ErrorIs(t, err, rpctypes.ErrPermissionDenied)
	noneSession := session(t, none)
	tctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.ErrorIs(t, etcdsync.NewMutex(noneSession, "locks/job").TryLock(tctx), rpctypes.ErrPermissionDenied)
	require.ErrorIs(t, etcdsync.NewMutex(noneSession, "locks/job").Lock(tctx), rpctypes.ErrPermissionDenied)
	_, err = waiter.Do(ctx, clientv3.OpPut("locks/job-state", "still mine"))
	require.NoError(t, err, "the hold survives")
	require.NoError(t, waiter.Unlock(ctx))
	require.NoError(t, e.Resign(ctx))
	require.Empty(t, keys(t, root, "locks/job/"))
	require.Empty(t, keys(t, root, "locks/elect/"))
}

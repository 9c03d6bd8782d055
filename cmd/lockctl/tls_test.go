//go:build unix

package main

import (
	"context"
	"strings"
	"testing"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// TLS and auth, with etcdctl's flags and environment: a member serving
// clients over TLS with auth on, users root, "rw" (read-write on locks/)
// and "ro" (read-only on locks/).
func TestTLSAndAuth(t *testing.T) {
	t.Parallel()
	certs, err := etcdtest.MakeCerts(t.TempDir())
	require.NoError(t, err)
	c := etcdtest.Start(t, etcdtest.Options{TLS: certs})
	ep := c.Endpoints()[0]
	cfg := etcdtest.ClientConfig(c.Endpoints())
	cfg.TLS = certs.ClientTLS()
	root, err := clientv3.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { root.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	etcdtest.EnableAuth(t, ctx, root, map[string]string{"root": "root", "rw": "locks-rw", "ro": "locks-ro"})
	// From now on, root must say who it is.
	root.Close()
	cfg.Username, cfg.Password = "root", etcdtest.Password("root")
	root, err = clientv3.New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { root.Close() })
	left := func(t *testing.T, name string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout) // each its own: the whole test may take longer under -race
		defer cancel()
		resp, err := root.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
		require.NoError(t, err)
		require.Zero(t, resp.Count, "keys left under %s", name)
	}
	// A long --dial-timeout: under -race and a loaded machine, the member's
	// password checks (bcrypt) can take seconds; the checks below are of
	// what fails, not of how fast.
	tlsFlags := []string{"--endpoints", ep, "--cacert", certs.CAFile, "--dial-timeout", "30s"}

	// Flags: a read-write user runs a command under the lock.
	code, p := run(t, append(tlsFlags, "--user", "rw:rw-password", "run", "locks/job", "--", "sh", "-c", `echo "$ETCDSYNC_KEY"`)...)
	require.Equal(t, 0, code, "stderr: %s", p.stderr.String())
	require.True(t, strings.HasPrefix(p.stdout.String(), "locks/job/"), "%q", p.stdout.String())
	left(t, "locks/job")

	// etcdctl's environment variables, and a client certificate (the
	// member does not ask for one, but it must load).
	p = startWith(t, opts{env: []string{
		"ETCDCTL_ENDPOINTS=" + ep, "ETCDCTL_CACERT=" + certs.CAFile,
		"ETCDCTL_CERT=" + certs.CertFile, "ETCDCTL_KEY=" + certs.KeyFile,
		"ETCDCTL_USER=rw", "ETCDCTL_PASSWORD=rw-password",
	}}, "run", "locks/env", "--", "true")
	require.Equal(t, 0, p.wait(t), "stderr: %s", p.stderr.String())
	code, p = run(t, "--endpoints", ep, "--insecure-skip-tls-verify", "--user", "rw:rw-password", "holders", "-o", "json", "locks/env")
	require.Equal(t, 0, code, "stderr: %s", p.stderr.String())
	require.Equal(t, "[]\n", p.stdout.String())

	for _, tc := range []struct {
		name string
		args []string
		says string
	}{
		{"wrong password", append(tlsFlags, "--user", "rw:nope", "run", "locks/bad", "--", "true"), "authentication failed"},
		{"read-only user", append(tlsFlags, "--user", "ro:ro-password", "run", "locks/bad", "--", "true"), "permission denied"},
		{"no CA", []string{"--endpoints", ep, "--dial-timeout", "1s", "--user", "rw:rw-password", "run", "locks/bad", "--", "true"}, "certificate"},
		{"no user", append(tlsFlags, "run", "locks/bad", "--", "true"), "user name is empty"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, p := run(t, tc.args...)
			require.Equal(t, exitFailure, code, "stderr: %s", p.stderr.String())
			line := oneLine(t, p.stderr.String())
			t.Log(line)
			require.Contains(t, line, tc.says)
			left(t, "locks/bad")
		})
	}
}

package etcdsynctest

import (
	"bytes"
	"context"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// noEnv is an environment with no variable set.
func noEnv(string) string { return "" }

// Without ETCD_ENDPOINTS Connect starts a member, says where, and close
// stops it.
func TestConnectEmbedded(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	cli, closeAll, err := connect(&out, "ETCD_ENDPOINTS", " ", noEnv)
	require.NoError(t, err)
	ep := cli.Endpoints()[0]
	require.Equal(t, "started an embedded etcd at "+ep+" (set ETCD_ENDPOINTS to use a real cluster)\n", out.String())
	u, err := url.Parse(ep)
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1", u.Hostname())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = cli.Put(ctx, "k", "v")
	require.NoError(t, err)

	closeAll()
	closeAll()
	require.Error(t, cli.Ctx().Err(), "client open after close")
	if conn, err := net.DialTimeout("tcp", u.Host, time.Second); err == nil {
		conn.Close()
		t.Fatalf("%s still accepts connections after close", ep)
	}
}

// With ETCD_ENDPOINTS Connect uses them, says so, and close leaves them be.
func TestConnectEndpoints(t *testing.T) {
	t.Parallel()
	admin := Start(t)
	ep := admin.Endpoints()[0]
	var out bytes.Buffer
	cli, closeAll, err := connect(&out, "ETCD_ENDPOINTS", " "+ep+" ,", noEnv)
	require.NoError(t, err)
	require.Equal(t, "connected to ETCD_ENDPOINTS="+ep+"\n", out.String())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = cli.Put(ctx, "k", "v")
	require.NoError(t, err)

	closeAll()
	require.Error(t, cli.Ctx().Err(), "client open after close")
	_, err = admin.Get(ctx, "k")
	require.NoError(t, err, "close stopped a server it did not start")
}

// Connect reads ETCD_ENDPOINTS, else ETCDCTL_ENDPOINTS, as lockctl does.
func TestConnectReadsEitherEndpointsVariable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		env         map[string]string
		name, value string
	}{
		{map[string]string{"ETCD_ENDPOINTS": "a", "ETCDCTL_ENDPOINTS": "b"}, "ETCD_ENDPOINTS", "a"},
		{map[string]string{"ETCD_ENDPOINTS": " ", "ETCDCTL_ENDPOINTS": "b"}, "ETCDCTL_ENDPOINTS", "b"},
		{map[string]string{"ETCDCTL_ENDPOINTS": "b"}, "ETCDCTL_ENDPOINTS", "b"},
		{map[string]string{}, "ETCDCTL_ENDPOINTS", ""},
	} {
		name, value := endpointsEnv(func(k string) string { return tc.env[k] })
		require.Equal(t, tc.name, name, "%v", tc.env)
		require.Equal(t, tc.value, value, "%v", tc.env)
	}
}

// ETCD_ENDPOINTS where nothing answers: an error within the bound, naming them.
func TestConnectNoAnswer(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ep := "http://" + ln.Addr().String()
	ln.Close()
	var out bytes.Buffer
	start := time.Now()
	_, _, err = connect(&out, "ETCD_ENDPOINTS", ep, noEnv)
	require.Error(t, err)
	require.Contains(t, err.Error(), "ETCD_ENDPOINTS="+ep)
	require.Less(t, time.Since(start), connectTimeout+5*time.Second)
	require.Empty(t, strings.TrimSpace(out.String()))
}

// With ETCD_CACERT and ETCD_USER Connect reaches a member that serves TLS
// and requires a password; without the user it is refused.
func TestConnectTLSAndAuth(t *testing.T) {
	t.Parallel()
	certs, err := etcdtest.MakeCerts(t.TempDir())
	require.NoError(t, err)
	c := etcdtest.Start(t, etcdtest.Options{TLS: certs})
	ep := c.Endpoints()[0]
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	admin, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, TLS: certs.ClientTLS(), DialTimeout: 5 * time.Second})
	require.NoError(t, err)
	defer admin.Close()
	_, err = admin.UserAdd(ctx, "root", "secret")
	require.NoError(t, err)
	_, err = admin.UserGrantRole(ctx, "root", "root")
	require.NoError(t, err)
	_, err = admin.AuthEnable(ctx)
	require.NoError(t, err)

	env := map[string]string{"ETCD_CACERT": certs.CAFile}
	getenv := func(k string) string { return env[k] }
	for _, user := range []map[string]string{
		{"ETCD_USER": "root:secret"},
		{"ETCD_USER": "root", "ETCD_PASSWORD": "secret"},
	} {
		for k, v := range user {
			env[k] = v
		}
		var out bytes.Buffer
		cli, closeAll, err := connect(&out, "ETCD_ENDPOINTS", ep, getenv)
		require.NoError(t, err)
		_, err = cli.Put(ctx, "k", "v")
		require.NoError(t, err)
		closeAll()
		env["ETCD_PASSWORD"] = ""
	}

	env["ETCD_USER"] = ""
	_, _, err = connect(&bytes.Buffer{}, "ETCD_ENDPOINTS", ep, getenv)
	require.Error(t, err, "a member that requires a password let a client in without one")

	env["ETCD_CACERT"] = ""
	env["ETCD_USER"] = "root:secret"
	_, _, err = connect(&bytes.Buffer{}, "ETCD_ENDPOINTS", ep, getenv)
	require.Error(t, err, "a member with a certificate of an unknown CA was trusted")

	env["ETCD_CERT"] = certs.CertFile
	_, _, err = connect(&bytes.Buffer{}, "ETCD_ENDPOINTS", ep, getenv)
	require.ErrorContains(t, err, "ETCD_CERT and ETCD_KEY go together")
}

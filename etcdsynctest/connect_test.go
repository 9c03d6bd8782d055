package etcdsynctest

import (
	"bytes"
	"context"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Without ETCD_ENDPOINTS Connect starts a member, says where, and close
// stops it.
func TestConnectEmbedded(t *testing.T) {
	var out bytes.Buffer
	cli, closeAll, err := connect(&out, " ")
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
	admin := Start(t)
	ep := admin.Endpoints()[0]
	var out bytes.Buffer
	cli, closeAll, err := connect(&out, " "+ep+" ,")
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

// ETCD_ENDPOINTS where nothing answers: an error within the bound, naming them.
func TestConnectNoAnswer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ep := "http://" + ln.Addr().String()
	ln.Close()
	var out bytes.Buffer
	start := time.Now()
	_, _, err = connect(&out, ep)
	require.Error(t, err)
	require.Contains(t, err.Error(), "ETCD_ENDPOINTS="+ep)
	require.Less(t, time.Since(start), connectTimeout+5*time.Second)
	require.Empty(t, strings.TrimSpace(out.String()))
}

// Package reach says why etcd's endpoints cannot be reached, for error
// messages on a failed first call: it dials each endpoint's address (TCP, or
// a Unix socket; and TLS when told the client's configuration) without
// speaking gRPC, so it needs nothing of the client
// (a namespaced, proxied or in-process client alike). None tells a caller
// that nothing can be dialled at all (NewSession then stops waiting).
package reach

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/url"
	"strings"
	"sync"
	"time"
)

// Why dials every endpoint at once, each bounded by timeout, and returns
// what failed, as "ENDPOINT: ERROR; ...", or "" when every dial succeeded
// (the trouble is elsewhere) or there are no endpoints. With tc (the
// client's TLS configuration; nil when unknown, and then no handshake is
// tried) it also makes the TLS handshake with the https:// and unixs://
// endpoints, so that a certificate the client refuses is named. It blocks
// for at most timeout.
func Why(endpoints []string, tc *tls.Config, timeout time.Duration) string {
	why, _ := dialAll(context.Background(), endpoints, tc, timeout)
	return why
}

// None is Why (without TLS, ending early with ctx), and also reports
// whether none of the endpoints could be dialled: false with no endpoints,
// and false when one is not an address this package can dial (a resolver
// target such as dns:///host, which only the client's own resolver knows).
func None(ctx context.Context, endpoints []string, timeout time.Duration) (why string, none bool) {
	for _, ep := range endpoints {
		if !dialable(ep) {
			return "", false
		}
	}
	return dialAll(ctx, endpoints, nil, timeout)
}

// dialable reports whether ep is a bare host:port or an http(s)/unix(s)
// URL, the forms address knows.
func dialable(ep string) bool {
	u, err := url.Parse(ep)
	if err != nil || !strings.Contains(ep, "://") {
		return true // a bare host:port
	}
	switch u.Scheme {
	case "http", "https", "unix", "unixs":
		return true
	}
	return false
}

// dialAll dials every endpoint (see Why) and returns what failed and
// whether every one did.
func dialAll(parent context.Context, endpoints []string, tc *tls.Config, timeout time.Duration) (string, bool) {
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()
	why := make([]string, len(endpoints))
	var wg sync.WaitGroup
	for i, ep := range endpoints {
		wg.Go(func() {
			network, addr := address(ep)
			var conn net.Conn
			var err error
			if tc != nil && (strings.HasPrefix(ep, "https://") || strings.HasPrefix(ep, "unixs://")) {
				conn, err = (&tls.Dialer{Config: tc}).DialContext(ctx, network, addr)
			} else {
				conn, err = (&net.Dialer{}).DialContext(ctx, network, addr)
			}
			if err != nil {
				var op *net.OpError
				if errors.As(err, &op) && op.Err != nil {
					err = op.Err
				}
				why[i] = ep + ": " + err.Error()
				return
			}
			conn.Close()
		})
	}
	wg.Wait()
	var out []string
	for _, w := range why {
		if w != "" {
			out = append(out, w)
		}
	}
	return strings.Join(out, "; "), len(out) > 0 && len(out) == len(endpoints)
}

// address returns the network and address an endpoint names: "unix" for
// unix:// and unixs:// endpoints, else "tcp" and the host:port of a URL or
// of a bare address.
func address(ep string) (network, addr string) {
	u, err := url.Parse(ep)
	switch {
	case err != nil || u.Host == "" && u.Path == "":
		return "tcp", ep
	case u.Scheme == "unix" || u.Scheme == "unixs":
		return "unix", u.Host + u.Path
	case u.Host != "":
		return "tcp", u.Host
	}
	return "tcp", ep
}

// Package reach says why etcd's endpoints cannot be reached, for error
// messages on a failed first call: it dials each endpoint's address (TCP, or
// a Unix socket; and TLS when told the client's configuration) without
// speaking gRPC, so it needs nothing of the client
// (a namespaced, proxied or in-process client alike). Each says of every
// endpoint whether it accepts connections (one that does and never answers
// is silent, not down).
package reach

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"net/url"
	"slices"
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
	return failures(endpoints, tc, timeout)
}

// Each dials every endpoint at once (see Why; without TLS), each bounded by
// timeout, and says of each what it found, as "ENDPOINT: ERROR" or
// "ENDPOINT: accepted a connection", joined by "; ". An endpoint that is not
// an address this package can dial (a resolver target such as dns:///host,
// which only the client's own resolver knows) is "ENDPOINT: not dialled".
// It blocks for at most timeout.
func Each(endpoints []string, timeout time.Duration) string {
	var eps []string
	for _, ep := range endpoints {
		if dialable(ep) {
			eps = append(eps, ep)
		}
	}
	results := dial(eps, nil, timeout)
	out := make([]string, 0, len(endpoints))
	for _, ep := range endpoints {
		switch i := slices.Index(eps, ep); {
		case i < 0:
			out = append(out, ep+": not dialled")
		case results[i] == "":
			out = append(out, ep+": accepted a connection")
		default:
			out = append(out, results[i])
		}
	}
	return strings.Join(out, "; ")
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

// failures dials every endpoint (see Why) and returns what failed.
func failures(endpoints []string, tc *tls.Config, timeout time.Duration) string {
	var out []string
	for _, w := range dial(endpoints, tc, timeout) {
		if w != "" {
			out = append(out, w)
		}
	}
	return strings.Join(out, "; ")
}

// dial dials every endpoint at once (see Why) and returns, for each, "" when
// the dial succeeded, else "ENDPOINT: ERROR".
func dial(endpoints []string, tc *tls.Config, timeout time.Duration) []string {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
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
	return why
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

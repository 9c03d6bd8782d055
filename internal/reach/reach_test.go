package reach

import (
	"crypto/tls"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

func TestWhySaysWhichEndpointRefuses(t *testing.T) {
	up, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	down, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	downAddr := down.Addr().String()
	down.Close() // nobody listens there now
	why := Why([]string{"http://" + up.Addr().String(), downAddr}, nil, time.Second)
	if !strings.Contains(why, downAddr+": ") || !strings.Contains(why, "connection refused") || strings.Contains(why, up.Addr().String()) {
		t.Fatalf("Why = %q, want the refused endpoint only", why)
	}
	if why := Why([]string{"http://" + up.Addr().String()}, nil, time.Second); why != "" {
		t.Fatalf("Why of a listening endpoint = %q, want \"\"", why)
	}
	if why := Why(nil, nil, time.Second); why != "" {
		t.Fatalf("Why of no endpoints = %q", why)
	}
	each := Each([]string{"http://" + up.Addr().String(), downAddr, "dns:///" + downAddr}, time.Second)
	for _, want := range []string{"http://" + up.Addr().String() + ": accepted a connection", downAddr + ": connect: connection refused", "dns:///" + downAddr + ": not dialled"} {
		if !strings.Contains(each, want) {
			t.Fatalf("Each = %q, want %q in it", each, want)
		}
	}
}

func TestAddressOfEachEndpointForm(t *testing.T) {
	for ep, want := range map[string][2]string{
		"http://127.0.0.1:2379":   {"tcp", "127.0.0.1:2379"},
		"https://etcd.local:2379": {"tcp", "etcd.local:2379"},
		"127.0.0.1:2379":          {"tcp", "127.0.0.1:2379"},
		"unix:///run/etcd.sock":   {"unix", "/run/etcd.sock"},
		"unix://localhost:2379":   {"unix", "localhost:2379"},
	} {
		if n, a := address(ep); n != want[0] || a != want[1] {
			t.Errorf("address(%q) = %s %s, want %v", ep, n, a, want)
		}
	}
}

func TestWhyNamesACertificateTheClientRefuses(t *testing.T) {
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	defer srv.Close()
	ep := srv.URL // https://127.0.0.1:PORT, a certificate of httptest's own CA
	if why := Why([]string{ep}, &tls.Config{MinVersion: tls.VersionTLS12}, time.Second); !strings.Contains(why, "certificate") {
		t.Fatalf("Why = %q, want the certificate named", why)
	}
	if why := Why([]string{ep}, nil, time.Second); why != "" {
		t.Fatalf("Why without a TLS configuration = %q, want \"\" (no handshake)", why)
	}
	if why := Why([]string{ep}, srv.Client().Transport.(*http.Transport).TLSClientConfig, time.Second); why != "" {
		t.Fatalf("Why with the server's CA = %q, want \"\"", why)
	}
}

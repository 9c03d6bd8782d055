package etcdsynctest

import "go.uber.org/goleak"

// IgnoredGoroutines are the goroutines an embedded etcd leaves for the
// life of the process, for a test that checks for leaks with goleak:
//
//	func TestMain(m *testing.M) {
//		goleak.VerifyTestMain(m, etcdsynctest.IgnoredGoroutines()...)
//	}
func IgnoredGoroutines() []goleak.Option {
	return []goleak.Option{
		// gRPC and opencensus internals, started on first use.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
		// Idle keep-alive connections of the members' peer HTTP transport
		// outlive a member's Close by a moment.
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreAnyFunction("net/http.(*connReader).backgroundRead"),
		goleak.IgnoreAnyFunction("net/http.(*conn).serve"),
		// The server's lock and election APIs keep leases alive through an
		// in-process client the embedded server never closes.
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/server/v3/proxy/grpcproxy/adapter.(*chanStream).RecvMsg"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/server/v3/etcdserver/api/v3rpc.(*LeaseServer).LeaseKeepAlive"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/client/v3.(*lessor).sendKeepAliveLoop"),
		goleak.IgnoreAnyFunction("go.etcd.io/etcd/client/v3.(*lessor).deadlineLoop"),
	}
}

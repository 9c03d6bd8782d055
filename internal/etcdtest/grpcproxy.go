package etcdtest

// etcd's gRPC proxy (the tier `etcd grpc-proxy start` runs), served in
// process on 127.0.0.1: KV, Watch, Lease and Maintenance, as a client of
// the given endpoints.

import (
	"context"
	"net"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/server/v3/proxy/grpcproxy"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// StartGRPCProxy serves etcd's gRPC proxy of endpoints on a free port of
// 127.0.0.1 until tb's cleanup, and returns its address (host:port). dial
// are options of the proxy's own client of the endpoints.
func StartGRPCProxy(tb TB, endpoints []string, dial ...grpc.DialOption) string {
	tb.Helper()
	back := NewClient(tb, endpoints, dial...)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("etcdtest: grpc proxy: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	kvp, _ := grpcproxy.NewKvProxy(back)
	watchp, watchDone := grpcproxy.NewWatchProxy(ctx, zap.NewNop(), back)
	leasep, leaseDone := grpcproxy.NewLeaseProxy(ctx, back)
	srv := grpc.NewServer()
	pb.RegisterKVServer(srv, kvp)
	pb.RegisterWatchServer(srv, watchp)
	pb.RegisterLeaseServer(srv, leasep)
	pb.RegisterMaintenanceServer(srv, grpcproxy.NewMaintenanceProxy(back))
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ln) }()
	tb.Cleanup(func() {
		cancel()
		srv.Stop()
		<-served
		<-watchDone
		<-leaseDone
	})
	return ln.Addr().String()
}

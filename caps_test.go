package etcdsync

// What a client learns about its servers (caps), without a server: when a
// progress answer may confirm a turn, and when a wait asks again.

import (
	"context"
	"net"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// Progress answers are trusted from release 3.6.0 on. Servers before the
// fix of etcd#15220 read; so do 3.5 releases with the fix (a client is
// judged once, and a 3.5 member before 3.5.8 could go unseen), 3.4 whatever
// its patch, and pre-releases.
func TestCapsProgressOrderedFromTheFix(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{
		// Before the fix: a read per handoff.
		"3.3.27": false, "3.4.0": false, "3.4.23": false, "3.4.24": false,
		"3.5.0": false, "3.5.7": false, "3.5.7-rc.0": false,
		// The fix in 3.4 and 3.5 lines: still a read (see progressOrdered).
		"3.4.25": false, "3.4.37": false, "3.5.8": false, "3.5.17": false, "3.5.35": false,
		// Releases from 3.6.0: a progress request.
		"3.6.0": true, "3.6.16": true, "3.7.3": true, "4.0.0": true,
		// Pre-releases: read.
		"3.6.0-alpha.0": false, "3.6.0-rc.1": false,
		// Not a version: read.
		"": false, "3": false, "x.y.z": false, "3.5": false, "3.6": false, "3.5.x": false, "3.5.8-rc.0": false, "2.3.8": false,
	} {
		if got := progressOrdered(v); got != want {
			t.Errorf("progressOrdered(%q) = %v, want %v", v, got, want)
		}
	}
}

func TestCapsUnansweredUntilAProbeIsAnswered(t *testing.T) {
	t.Parallel()
	var c caps
	c.state.Store(capsProgress)
	if !c.probing() {
		t.Fatal("a client with no answer yet: its waits probe")
	}
	c.unanswered()
	if !c.cached() || c.state.Load() != capsUnanswered {
		t.Fatal("an unanswered request marks a client that never answered")
	}
	if c.probing() {
		t.Fatal("a marked client probes again only after reprobeAfter")
	}
	c.reprobe.Store(time.Now().Add(-time.Second).UnixNano()) // reprobeAfter has passed
	if !c.probing() {
		t.Fatal("a marked client probes again once reprobeAfter has passed")
	}
	if c.probing() {
		t.Fatal("one wait per reprobeAfter probes a marked client")
	}
	c.answer()
	if c.cached() || c.state.Load() != capsProgress {
		t.Fatal("an answered probe clears the mark")
	}
	if c.probing() {
		t.Fatal("a client that answered: its waits do not probe")
	}
	c.unanswered()
	if c.state.Load() != capsProgress {
		t.Fatal("a late answer does not mark a client that answered before")
	}
}

func TestCapsOldServerNeverAsks(t *testing.T) {
	t.Parallel()
	var c caps
	c.state.Store(capsOldServer)
	c.unanswered()
	if c.probing() || c.cached() || c.state.Load() != capsOldServer {
		t.Fatal("a client of servers released before the fix of etcd#15220 reads, and is never marked or probed")
	}
}

// statusServer is a gRPC server that answers Maintenance.Status with
// version, as an etcd member of that release would, on a port of its own;
// stop takes it down.
type statusServer struct {
	pb.UnimplementedMaintenanceServer
	version string
	addr    string
	srv     *grpc.Server
}

func (s *statusServer) Status(context.Context, *pb.StatusRequest) (*pb.StatusResponse, error) {
	return &pb.StatusResponse{Header: &pb.ResponseHeader{MemberId: 1}, Version: s.version}, nil
}

// startStatusServer serves s on addr ("" for a new port).
func startStatusServer(t *testing.T, version, addr string) *statusServer {
	t.Helper()
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	s := &statusServer{version: version, addr: lis.Addr().String(), srv: grpc.NewServer()}
	pb.RegisterMaintenanceServer(s.srv, s)
	go s.srv.Serve(lis)
	t.Cleanup(s.srv.Stop)
	return s
}

// A member that does not answer the version check (down for a moment,
// restarting, or slower than versionTimeout) may be one released before the
// fix of etcd#15220: a rolling upgrade 3.5.7 -> 3.5.35 has members of both
// releases, all of the 3.5 line, which etcd's upgrade rules allow. The
// client's watch streams may later go to that member, and its progress
// answers may overtake the deletes they vouch for. A client with an
// endpoint whose version is unknown should not be trusted (or should be
// asked again once that endpoint answers).
func TestCapsAMemberThatDidNotAnswerIsNotTrusted(t *testing.T) {
	t.Parallel()
	upgraded := startStatusServer(t, "3.5.35", "")
	old := startStatusServer(t, "3.5.7", "")
	old.srv.Stop() // down while the client asks
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{upgraded.addr, old.addr}})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	c := capsOf(cli)
	trusted := c.progress(context.Background(), cli)
	startStatusServer(t, "3.5.7", old.addr) // back, still 3.5.7
	trustedLater := c.progress(context.Background(), cli)
	if trusted || trustedLater {
		t.Errorf("endpoints 3.5.35 and 3.5.7 (down when asked): progress answers trusted (first %v, once it is back %v); a 3.5.7 member's answers may overtake the deletes they vouch for", trusted, trustedLater)
	}
}

// Builds from etcd's main branch between the 3.5 branch cut (2021) and
// etcd#15237 (merged in 2023) report "3.6.0-alpha.0" and lack the fix of
// etcd#15220 (later main builds report the same string with it). The rule
// refuses every pre-release.
func TestCapsProgressPreReleaseOfThe36LineIsNotTrusted(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"3.6.0-alpha.0"} {
		if progressOrdered(v) {
			t.Errorf("progressOrdered(%q) = true: a main-branch build of 2021-2023 reports it without the fix", v)
		}
	}
}

// A version with build metadata, a suffix or a sign is refused (reads),
// never misread as a trusted release.
func TestCapsProgressSuffixedPatchIsRefused(t *testing.T) {
	t.Parallel()
	for _, v := range []string{"3.5.10+custom", "3.5.35-custom", "3.5.8 ", " 3.5.8", "3.5.-8", "3.6.+0", "+3.6.0", "3.+6.0", "3.6.0-custom"} {
		if progressOrdered(v) {
			t.Errorf("progressOrdered(%q) = true, want a read", v)
		}
	}
}

//go:build unix

package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
)

// The tests run the real binary against one embedded etcd member.
var (
	bin      string           // the lockctl binary, built by TestMain
	endpoint string           // the member's client URL
	admin    *clientv3.Client // a client of the member, for checks
)

// testTimeout bounds every wait of a test.
const testTimeout = 20 * time.Second

func TestMain(m *testing.M) { os.Exit(testMain(m)) }

func testMain(m *testing.M) int {
	if err := etcdtest.DefaultParallel(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	dir, err := os.MkdirTemp("", "lockctl-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	bin = filepath.Join(dir, "lockctl")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	build := append(append([]string{"build"}, raceFlags...), "-o", bin, ".")
	out, err := exec.CommandContext(ctx, "go", build...).CombinedOutput()
	cancel()
	if err != nil {
		fmt.Fprintf(os.Stderr, "go build: %v\n%s", err, out)
		return 1
	}
	endpoints, stopEtcd, err := etcdsynctest.StartServer()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	endpoint = endpoints[0]
	admin, err = clientv3.New(etcdtest.ClientConfig(endpoints))
	if err != nil {
		stopEtcd()
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	code := m.Run()
	admin.Close()
	stopEtcd()
	if code == 0 {
		if err := goleak.Find(etcdsynctest.IgnoredGoroutines()...); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	return code
}

// buffer is a bytes.Buffer safe for a process's writes and a test's reads.
type buffer struct {
	mu    sync.Mutex
	b     bytes.Buffer
	wrote chan struct{} // closed by the next write (see next); nil: nobody waits
}

func (b *buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.wrote != nil {
		close(b.wrote)
		b.wrote = nil
	}
	return b.b.Write(p)
}

// next returns what was written so far, and a channel closed by the next
// write.
func (b *buffer) next() (string, <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.wrote == nil {
		b.wrote = make(chan struct{})
	}
	return b.b.String(), b.wrote
}

func (b *buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// ctl is one lockctl process.
type ctl struct {
	cmd            *exec.Cmd
	stdout, stderr buffer
	done           chan struct{} // closed when it has exited
	started, ended time.Time     // ended is set once done is closed
}

// opts tune a lockctl process: extra environment (over
// ETCDCTL_ENDPOINTS=the member), stdin, and another binary than the built
// one (a copy of it).
type opts struct {
	env   []string
	stdin string
	bin   string
}

// start starts lockctl with args. It is bounded by a minute, and stopped
// (SIGTERM, then SIGKILL after 15s) and waited for in the test's cleanup.
func start(t *testing.T, args ...string) *ctl { return startWith(t, opts{}, args...) }

func startWith(t *testing.T, o opts, args ...string) *ctl {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	p := &ctl{done: make(chan struct{})}
	path := bin
	if o.bin != "" {
		path = o.bin
	}
	p.cmd = exec.CommandContext(ctx, path, args...)
	p.cmd.Env = append(append(os.Environ(), "ETCDCTL_ENDPOINTS="+endpoint), o.env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.stdout, &p.stderr
	p.cmd.Stdin = strings.NewReader(o.stdin)
	p.cmd.Cancel = func() error { return p.cmd.Process.Signal(syscall.SIGTERM) }
	p.cmd.WaitDelay = 15 * time.Second
	p.started = time.Now()
	if err := p.cmd.Start(); err != nil {
		cancel()
		t.Fatalf("start lockctl: %v", err)
	}
	go func() {
		defer close(p.done)
		defer cancel()
		p.cmd.Wait()
		p.ended = time.Now()
	}()
	t.Cleanup(func() {
		cancel() // SIGTERM, SIGKILL after WaitDelay
		<-p.done
	})
	return p
}

// wait waits for p to exit, at most testTimeout, and returns its exit code.
func (p *ctl) wait(t *testing.T) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(testTimeout):
		t.Fatalf("lockctl %q did not exit within %v; stderr: %s", p.cmd.Args[1:], testTimeout, p.stderr.String())
	}
	return p.cmd.ProcessState.ExitCode()
}

// running reports whether p has not exited yet.
func (p *ctl) running() bool {
	select {
	case <-p.done:
		return false
	default:
		return true
	}
}

// signal sends sig to lockctl.
func (p *ctl) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(sig))
}

// run runs lockctl to its end and returns its exit code.
func run(t *testing.T, args ...string) (code int, p *ctl) {
	t.Helper()
	p = start(t, args...)
	return p.wait(t), p
}

// oneLine checks that s is exactly one line starting with "lockctl: " and
// returns it.
func oneLine(t *testing.T, s string) string {
	t.Helper()
	lines := strings.Split(strings.TrimSuffix(s, "\n"), "\n")
	require.Len(t, lines, 1, "want one line on stderr, got %q", s)
	require.True(t, strings.HasPrefix(lines[0], "lockctl: "), "stderr %q", s)
	require.True(t, strings.HasSuffix(s, "\n"), "stderr %q", s)
	return lines[0]
}

// eventually polls cond every 20ms until it holds, at most testTimeout.
func eventually(t *testing.T, cond func() bool, format string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: "+format, append([]any{testTimeout}, args...)...)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// keys returns the keys under prefix, oldest first.
func keys(t *testing.T, prefix string) []*mvccpb.KeyValue {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := admin.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	require.NoError(t, err)
	return resp.Kvs
}

// waitKeys waits until prefix has n keys and returns them.
func waitKeys(t *testing.T, prefix string, n int) []*mvccpb.KeyValue {
	t.Helper()
	var kvs []*mvccpb.KeyValue
	eventually(t, func() bool { kvs = keys(t, prefix); return len(kvs) == n }, "%d keys under %s (have %d)", n, prefix, len(kvs))
	return kvs
}

// noKeys checks that nothing is left under name.
func noKeys(t *testing.T, name string) {
	t.Helper()
	require.Empty(t, keys(t, name+"/"), "keys left under %s", name)
}

// leaseGone checks that the lease (hex) no longer exists.
func leaseGone(t *testing.T, hex string) {
	t.Helper()
	id, err := strconv.ParseInt(hex, 16, 64)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	resp, err := admin.TimeToLive(ctx, clientv3.LeaseID(id))
	require.NoError(t, err)
	require.Equal(t, int64(-1), resp.TTL, "lease %s still exists", hex)
}

// holding starts lockctl with args (the last the lock's name) running a
// command that waits until the file release, in dir, exists; it returns
// once the command runs (lockctl holds), with release.
func holding(t *testing.T, dir string, args ...string) (p *ctl, release string) {
	t.Helper()
	started, release := filepath.Join(dir, "started"), filepath.Join(dir, "release")
	p = start(t, append(args, "--", "sh", "-c", fmt.Sprintf("echo x > %q; %s", started, waitFor(release)))...)
	readFile(t, started)
	return p, release
}

// readFile waits until path exists and is non-empty, and returns it.
func readFile(t *testing.T, path string) string {
	t.Helper()
	var b []byte
	eventually(t, func() bool { b, _ = os.ReadFile(path); return len(b) > 0 }, "file %s", path)
	return string(b)
}

// touch creates path.
func touch(t *testing.T, path string) {
	t.Helper()
	require.NoError(t, os.WriteFile(path, []byte("x\n"), 0o644))
}

// waitFor is a shell snippet that waits until path exists, at most 30s
// (then the script exits 99).
func waitFor(path string) string {
	return fmt.Sprintf(`i=0; while [ ! -e %q ]; do i=$((i+1)); [ $i -gt 600 ] && exit 99; sleep 0.05; done`, path)
}

// gone reports whether process pid has ended (it does not exist, or is a
// zombie no one has reaped yet).
func gone(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return syscall.Kill(pid, 0) == syscall.ESRCH
	}
	// pid (comm) state ...: comm may hold spaces, the state follows the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i >= 0 && i+2 < len(s) && (s[i+2] == 'Z' || s[i+2] == 'X')
}

// uniqueName returns a name of its own for the test.
func uniqueName(t *testing.T) string {
	return "lockctl-test/" + strings.ReplaceAll(t.Name(), "/", "-")
}

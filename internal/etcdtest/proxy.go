package etcdtest

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy forwards TCP connections from 127.0.0.1 to one target. Blackhole
// stalls every connection in both directions, as a network partition does:
// nothing gets through, connections stay open, and what was in flight is
// delivered in order once the partition heals (TCP would retransmit it).
type Proxy struct {
	r          *relay
	mu         sync.Mutex
	blackholed bool
}

// NewProxy starts a proxy to target ("host:port") and closes it in tb's cleanup.
func NewProxy(tb TB, target string) *Proxy {
	tb.Helper()
	p := &Proxy{}
	r, err := newRelay(target, false, func(uint64) bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.blackholed
	})
	if err != nil {
		tb.Fatalf("etcdtest: proxy: %v", err)
	}
	p.r = r
	tb.Cleanup(p.Close)
	return p
}

// Endpoint returns the proxy's client URL.
func (p *Proxy) Endpoint() string { return "http://" + p.r.addr() }

// SetLatency delays every reply (target to client) by d from when the proxy
// read it, keeping order and spacing, as a slow link does; 0 ends the delay.
func (p *Proxy) SetLatency(d time.Duration) { p.r.latency.Store(int64(d)) }

// Blackhole stalls all traffic (or, with false, lets it flow again).
func (p *Proxy) Blackhole(on bool) {
	p.mu.Lock()
	p.blackholed = on
	p.mu.Unlock()
	p.r.notify()
}

// DropConnections closes every open connection; new ones are accepted.
func (p *Proxy) DropConnections() { p.r.dropConnections() }

// Close stops the proxy and waits for its goroutines.
func (p *Proxy) Close() { p.r.close() }

// relay is the TCP forwarder under Proxy and the peer proxies. Its owner
// decides, per connection, whether traffic is stalled: stalled is asked
// with the connection's sender (a member ID, 0 when unknown) before every
// chunk is forwarded, and a stalled chunk is held, never dropped, until
// the owner changes its mind and calls notify (or the relay closes).
//
// With sniff set the relay speaks just enough HTTP/1.1 to learn a
// connection's sender: it reads the client's requests one header block
// at a time until one carries X-Server-From, which etcd's rafthttp puts on
// every stream, pipeline and snapshot request to a peer. A connection is
// dialled by one member's transport, so its sender never changes; requests
// before the first X-Server-From (rafthttp's probes share the pipeline's
// keep-alive pool) leave it unknown until then. Bodies of such requests
// are skipped by Content-Length; a body framed otherwise (chunked) or a
// header block over maxHead ends sniffing and leaves the sender unknown.
type relay struct {
	ln      net.Listener
	target  string
	sniff   bool
	stalled func(from uint64) bool

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	changed chan struct{} // closed and replaced by notify
	done    bool          // closing: conns tracked from now on are closed at once

	latency atomic.Int64 // of replies (target to client), see Proxy.SetLatency

	wg        sync.WaitGroup
	closeOnce sync.Once
	closing   chan struct{}
}

// maxHead caps an HTTP request header block the relay reads to sniff a sender.
const maxHead = 64 << 10

var errHeadTooLong = errors.New("etcdtest: request header block over 64 KiB")

func newRelay(target string, sniff bool, stalled func(from uint64) bool) (*relay, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &relay{
		ln:      ln,
		target:  target,
		sniff:   sniff,
		stalled: stalled,
		conns:   make(map[net.Conn]struct{}),
		changed: make(chan struct{}),
		closing: make(chan struct{}),
	}
	r.wg.Add(1)
	go r.accept()
	return r, nil
}

func (r *relay) addr() string { return r.ln.Addr().String() }

// notify makes held traffic ask stalled again; call it after changing
// what stalled answers.
func (r *relay) notify() {
	r.mu.Lock()
	defer r.mu.Unlock()
	close(r.changed)
	r.changed = make(chan struct{})
}

// hold blocks while l is stalled; false when the relay is closing.
func (r *relay) hold(l *link) bool {
	for {
		// Take the channel before asking, so a change made after the
		// answer closes the channel this waits on.
		r.mu.Lock()
		changed := r.changed
		r.mu.Unlock()
		if !r.stalled(l.from.Load()) {
			return true
		}
		select {
		case <-changed:
		case <-r.closing:
			return false
		}
	}
}

func (r *relay) dropConnections() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for c := range r.conns {
		c.Close()
	}
}

// close stops the relay and waits for its goroutines.
func (r *relay) close() {
	r.closeOnce.Do(func() { close(r.closing) })
	r.ln.Close()
	r.mu.Lock()
	r.done = true
	r.mu.Unlock()
	r.dropConnections()
	r.wg.Wait()
}

// track records an open connection; false (and c closed) when closing.
func (r *relay) track(c net.Conn) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.done {
		c.Close()
		return false
	}
	r.conns[c] = struct{}{}
	return true
}

func (r *relay) hangUp(cs ...net.Conn) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, c := range cs {
		c.Close()
		delete(r.conns, c)
	}
}

func (r *relay) accept() {
	defer r.wg.Done()
	for {
		in, err := r.ln.Accept()
		if err != nil {
			return
		}
		if !r.track(in) {
			continue
		}
		r.wg.Add(1)
		go r.serve(in)
	}
}

// link is one proxied connection.
type link struct {
	from atomic.Uint64 // sender's member ID; 0 while unknown
}

func (r *relay) serve(in net.Conn) {
	defer r.wg.Done()
	out, err := net.DialTimeout("tcp", r.target, 5*time.Second)
	if err != nil {
		r.hangUp(in)
		return
	}
	if !r.track(out) {
		r.hangUp(in)
		return
	}
	l := &link{}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		defer r.hangUp(in, out)
		r.replies(l, out, in)
	}()
	defer r.hangUp(in, out)
	var src io.Reader = in
	if r.sniff {
		br := bufio.NewReaderSize(in, 32<<10)
		if !r.sniffSender(l, br, out) {
			return
		}
		src = br
	}
	r.copy(l, src, out)
}

// copy forwards src to dst in order, holding each chunk while l is
// stalled. It returns nil when src ends cleanly (io.EOF).
func (r *relay) copy(l *link, src io.Reader, dst net.Conn) error {
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if err := r.send(l, dst, buf[:n]); err != nil {
				return err
			}
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// replies forwards src to dst as copy does, each chunk no earlier than the
// relay's latency after it was read; reading goes on meanwhile, so chunks
// keep their order and spacing and a delay never adds up.
func (r *relay) replies(l *link, src, dst net.Conn) {
	type chunk struct {
		b   []byte
		due time.Time
	}
	q := make(chan chunk, 1024)
	written := make(chan struct{})
	go func() { // the writer; it drains q after a failure, so reads never block
		defer close(written)
		failed := false
		for c := range q {
			if failed {
				continue
			}
			timer := time.NewTimer(time.Until(c.due))
			select {
			case <-timer.C:
			case <-r.closing:
			}
			timer.Stop()
			if r.send(l, dst, c.b) != nil {
				failed = true
				r.hangUp(src, dst)
			}
		}
	}()
	defer func() {
		close(q)
		<-written
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			q <- chunk{b: bytes.Clone(buf[:n]), due: time.Now().Add(time.Duration(r.latency.Load()))}
		}
		if err != nil {
			return
		}
	}
}

var errClosing = errors.New("etcdtest: relay closing")

func (r *relay) send(l *link, dst net.Conn, b []byte) error {
	if !r.hold(l) {
		return errClosing
	}
	_, err := dst.Write(b)
	return err
}

// sniffSender forwards whole requests from br to dst until one names its
// sender (set in l before that request is forwarded) or sniffing cannot go
// on; true means the caller should pipe the rest as it comes.
func (r *relay) sniffSender(l *link, br *bufio.Reader, dst net.Conn) bool {
	for {
		head, err := readHead(br)
		if err == errHeadTooLong {
			return r.send(l, dst, head) == nil // give up: sender stays unknown
		}
		if err != nil {
			if len(head) > 0 {
				r.send(l, dst, head) // deliver what came before the client went away
			}
			return false
		}
		req, err := http.ReadRequest(bufio.NewReader(bytes.NewReader(head)))
		if err == nil {
			if id, perr := strconv.ParseUint(req.Header.Get("X-Server-From"), 16, 64); perr == nil && id != 0 {
				l.from.Store(id)
				return r.send(l, dst, head) == nil
			}
		}
		if r.send(l, dst, head) != nil {
			return false
		}
		if err != nil || req.ContentLength < 0 {
			return true // framing this relay does not follow: sender stays unknown
		}
		body := &io.LimitedReader{R: br, N: req.ContentLength}
		if r.copy(l, body, dst) != nil || body.N > 0 {
			return false
		}
	}
}

// readHead reads one HTTP header block: lines through the first empty one,
// at most maxHead bytes (errHeadTooLong then, with what was read).
func readHead(br *bufio.Reader) ([]byte, error) {
	var head []byte
	lineStart := true
	for {
		line, err := br.ReadSlice('\n')
		head = append(head, line...)
		switch {
		case err == bufio.ErrBufferFull:
			lineStart = false
		case err != nil:
			return head, err
		case lineStart && (string(line) == "\r\n" || string(line) == "\n"):
			return head, nil
		default:
			lineStart = true
		}
		if len(head) >= maxHead {
			return head, errHeadTooLong
		}
	}
}

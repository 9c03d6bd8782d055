package etcdtest

import (
	"net"
	"sync"
)

// Proxy forwards TCP connections from 127.0.0.1 to one target. Blackhole
// stalls every connection in both directions, as a network partition does:
// nothing gets through, connections stay open, and what was in flight is
// delivered in order once the partition heals (TCP would retransmit it).
type Proxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	healed chan struct{} // nil while traffic flows; closed on heal
	wg     sync.WaitGroup

	closeOnce sync.Once
	closing   chan struct{}
}

// NewProxy starts a proxy to target ("host:port") and closes it in tb's cleanup.
func NewProxy(tb TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("etcdtest: proxy: %v", err)
	}
	p := &Proxy{ln: ln, target: target, conns: make(map[net.Conn]struct{}), closing: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	tb.Cleanup(p.Close)
	return p
}

// Endpoint returns the proxy's client URL.
func (p *Proxy) Endpoint() string { return "http://" + p.ln.Addr().String() }

// Blackhole stalls all traffic (or, with false, lets it flow again).
func (p *Proxy) Blackhole(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case on && p.healed == nil:
		p.healed = make(chan struct{})
	case !on && p.healed != nil:
		close(p.healed)
		p.healed = nil
	}
}

// stall blocks while the proxy is blackholed; false when closing.
func (p *Proxy) stall(closing <-chan struct{}) bool {
	p.mu.Lock()
	healed := p.healed
	p.mu.Unlock()
	if healed == nil {
		return true
	}
	select {
	case <-healed:
		return true
	case <-closing:
		return false
	}
}

// DropConnections closes every open connection; new ones are accepted.
func (p *Proxy) DropConnections() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
}

// Close stops the proxy and waits for its goroutines.
func (p *Proxy) Close() {
	p.closeOnce.Do(func() { close(p.closing) })
	p.ln.Close()
	p.DropConnections()
	p.wg.Wait()
}

func (p *Proxy) track(c net.Conn, add bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if add {
		p.conns[c] = struct{}{}
	} else {
		delete(p.conns, c)
	}
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		in, err := p.ln.Accept()
		if err != nil {
			return
		}
		out, err := net.Dial("tcp", p.target)
		if err != nil {
			in.Close()
			continue
		}
		p.track(in, true)
		p.track(out, true)
		p.wg.Add(2)
		go p.pipe(in, out)
		go p.pipe(out, in)
	}
}

// pipe copies src to dst, holding bytes back while blackholed.
func (p *Proxy) pipe(src, dst net.Conn) {
	defer p.wg.Done()
	defer func() {
		src.Close()
		dst.Close()
		p.track(src, false)
		p.track(dst, false)
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.stall(p.closing) {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

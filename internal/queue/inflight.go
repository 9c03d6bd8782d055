package queue

// A count of what is in flight (type inFlight) that one may wait for,
// bounded: a session's stream reapers (goReap) and the Runs under its
// holds (BeginRun), which Close waits for.

import (
	"context"
	"sync"
)

// inFlight counts what is in flight (the goroutines closing waits'
// streams, goReap; the Runs under holds, BeginRun), and lets one wait,
// bounded, for none.
type inFlight struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n comes to 0; nil until waited for
}

func (r *inFlight) add() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.n++
}

func (r *inFlight) done() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.n--; r.n == 0 && r.idle != nil {
		close(r.idle)
		r.idle = nil
	}
}

// wait blocks until nothing counted is in flight, or ctx ends.
func (r *inFlight) wait(ctx context.Context) {
	r.mu.Lock()
	if r.n == 0 {
		r.mu.Unlock()
		return
	}
	if r.idle == nil {
		r.idle = make(chan struct{})
	}
	idle := r.idle
	r.mu.Unlock()
	select {
	case <-idle:
	case <-ctx.Done():
	}
}

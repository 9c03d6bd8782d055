//go:build unix

package main

// What lockctl says on stderr while it waits for a hold (type waitReport):
// one line once it has waited a second with its key queued behind a holder,
// one a minute while it still waits, and one when it gets the hold after
// that. --quiet turns them off. The queue is read with etcdsync.Holders, as
// lockctl holders reads it; the library is not told anything.

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/etcdsync/etcdsync"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// waitFirst is how long lockctl waits before it reads the queue and says
// that it waits: a hold taken sooner (most are taken in a round trip or
// two) costs no read and says nothing. It is a read, not a watch, that
// learns where the key stands: a watch would open a gRPC stream of its own,
// which with --user costs an Authenticate (a bcrypt on the server) on every
// run, and which etcd's client reports as an error on stderr when the take
// ends while it opens.
const waitFirst = time.Second

// waitEvery is how often lockctl says that it still waits.
const waitEvery = time.Minute

// waitHelp is the commands' help on what they say while they wait.
const waitHelp = `When it has waited a second because the lock is held, lockctl says so on
stderr, in one line: its place among the waiters (place 1 is next) and the
holder's key, lease, create revision and value. Then one line a minute while
it still waits, and one line when it gets the lock, with its key, its
revision (the fencing token) and how long it waited. --quiet turns these
lines off; errors are still printed.`

// waitReport says on w that lockctl waits for a hold on names, and for how
// long. Its goroutine starts in startWaitReport and ends in stop.
type waitReport struct {
	w       io.Writer
	cli     *clientv3.Client
	lease   clientv3.LeaseID // the session's: it marks this lockctl's keys
	names   []string         // sorted; several for a MultiLock
	what    string           // the hold, for the line about all names ("lock", "locks", "leadership", ...)
	each    string           // the hold on one name, for the lines about one name
	first   time.Duration    // before the first read (waitFirst)
	every   time.Duration    // between "still waiting" lines (waitEvery)
	timeout time.Duration    // bounds each read
	begun   time.Time

	cancel context.CancelFunc
	done   chan struct{}
	waited bool // a line said that it waits: written by the goroutine, read once done is closed
}

// startWaitReport starts saying on w that lockctl waits for the hold what
// (see hold.what) on names, taken with a session of lease on cli, from now
// on: it is called right before the take. It first reads the queue after
// first, then says that it still waits every every; each read is bounded by
// timeout. It does not block; the caller calls stop once the take has
// returned.
func startWaitReport(w io.Writer, cli *clientv3.Client, lease clientv3.LeaseID, names []string, what string, timeout, first, every time.Duration) *waitReport {
	ctx, cancel := context.WithCancel(context.Background())
	r := &waitReport{w: w, cli: cli, lease: lease, names: names, what: what, each: what, first: first, every: every, timeout: timeout, begun: time.Now(), cancel: cancel, done: make(chan struct{})}
	if len(names) > 1 {
		r.each = "lock"
	}
	go r.follow(ctx)
	return r
}

// stop ends the report and returns whether a line said that lockctl waits,
// and how long since the report started. It blocks until the goroutine has
// ended (a read in flight ends with it).
func (r *waitReport) stop() (waited bool, took time.Duration) {
	took = time.Since(r.begun)
	r.cancel()
	<-r.done
	return r.waited, took
}

// got says that lockctl holds, after took, with keys (in name order) of
// create revision rev.
func (r *waitReport) got(took time.Duration, keys []string, rev int64) {
	k := "key"
	if len(keys) > 1 {
		k = "keys"
	}
	r.say("got the %s on %s after %s: %s %s, revision %d", r.what, strings.Join(r.names, ", "), round(took), k, strings.Join(keys, ", "), rev)
}

// follow says that lockctl waits, until ctx ends: after r.first, once its
// key is queued and does not hold (it reads the queue again every r.first
// while the key is not queued yet), then every r.every from the start.
func (r *waitReport) follow(ctx context.Context) {
	defer close(r.done)
	first := time.NewTimer(r.first)
	defer first.Stop()
	tick := time.NewTicker(r.every)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-first.C:
			if queued, err := r.firstLine(ctx); !queued && err == nil {
				first.Reset(r.first)
			}
		case <-tick.C:
			r.still(ctx)
		}
	}
}

// firstLine reads the queues and says, for each name whose queue has this
// lockctl's key waiting, that it waits there. It returns whether the key
// was found queued (waiting or not), and the first error of its reads; the
// minute's lines say what fails.
func (r *waitReport) firstLine(ctx context.Context) (queued bool, err error) {
	for _, name := range r.names {
		p, rerr := r.read(ctx, name)
		switch {
		case rerr != nil:
			if err == nil {
				err = rerr
			}
			continue
		case p.ours == nil:
			continue
		}
		queued = true
		if !p.ours.Held {
			r.say("waiting for the %s on %s: %s", r.each, name, p)
			r.waited = true
		}
	}
	return queued, err
}

// still says, for each name whose queue does not hold this lockctl's key,
// that it still waits, for how long and behind whom.
func (r *waitReport) still(ctx context.Context) {
	d := round(time.Since(r.begun))
	for _, name := range r.names {
		p, err := r.read(ctx, name)
		switch {
		case ctx.Err() != nil: // the wait is over
			return
		case err != nil:
			r.say("still waiting for the %s on %s after %s (reading its queue failed: %s)", r.each, name, d, strings.Join(strings.Fields(err.Error()), " "))
		case p.ours == nil:
			r.say("still waiting for the %s on %s after %s: not queued yet", r.each, name, d)
		case p.ours.Held:
			continue
		default:
			r.say("still waiting for the %s on %s after %s: %s", r.each, name, d, p)
		}
		r.waited = true
	}
}

// read reads name's queues (one read, bounded by r.timeout and ctx) and
// returns where this lockctl's key stands in them.
func (r *waitReport) read(ctx context.Context, name string) (place, error) {
	rctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	es, err := etcdsync.Holders(rctx, r.cli, name)
	if err != nil {
		return place{}, err
	}
	return placeOf(es, r.lease), nil
}

// say writes one line, "lockctl: " and the message, to r.w.
func (r *waitReport) say(format string, args ...any) {
	msg := strings.NewReplacer("\n", " ", "\r", " ").Replace(fmt.Sprintf(format, args...))
	fmt.Fprintf(r.w, "lockctl: %s\n", msg)
}

// place is where a key stands in its queue on a name: the key, the number
// of waiters ahead of it, and the holders of that queue in queue order.
type place struct {
	ours    *etcdsync.Entry // nil: not queued
	ahead   int
	holders []etcdsync.Entry
}

// placeOf finds the key of lease in es (etcdsync.Holders' entries of one
// name) and where it stands in its queue: the direct children's, or an
// RWMutex's (as lockctl holders numbers them).
func placeOf(es []etcdsync.Entry, lease clientv3.LeaseID) place {
	var p place
	for i := range es {
		if es[i].Lease == lease {
			p.ours = &es[i]
			break
		}
	}
	if p.ours == nil {
		return p
	}
	rw := rwKind(p.ours.Kind)
	for i := range es {
		e := &es[i]
		switch {
		case rwKind(e.Kind) != rw:
		case e.Held:
			p.holders = append(p.holders, *e)
		case e.Rev < p.ours.Rev:
			p.ahead++
		}
	}
	return p
}

// rwKind reports whether kind is a key of an RWMutex's queue.
func rwKind(kind string) bool { return kind == "read" || kind == "write" }

// String says where the key stands: "place N in the queue", then who holds
// that queue: the first holder's key, lease, create revision and value (when
// it has one), and how many more hold.
func (p place) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "place %d in the queue, ", p.ahead+1)
	if len(p.holders) == 0 {
		b.WriteString("held by nobody now")
		return b.String()
	}
	h := p.holders[0]
	lease := "no lease"
	if h.Lease != clientv3.NoLease {
		lease = "lease " + strconv.FormatInt(int64(h.Lease), 16)
	}
	fmt.Fprintf(&b, "held by %s (%s) since revision %d", h.Key, lease, h.Rev)
	if len(h.Value) > 0 {
		fmt.Fprintf(&b, ", value %s", strconv.Quote(string(h.Value)))
	}
	if n := len(p.holders) - 1; n > 0 {
		fmt.Fprintf(&b, ", and %d more", n)
	}
	return b.String()
}

// round rounds a wait for a line: to the millisecond under a second, to
// 10ms under a minute, else to the second.
func round(d time.Duration) time.Duration {
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond)
	case d < time.Minute:
		return d.Round(10 * time.Millisecond)
	}
	return d.Round(time.Second)
}

package queue

// A key's place in its queue (type place): our key's create revision, the
// keys ahead of it that block it as the last list showed (list), of which
// a waiter away from the front keeps only the nearest (keepNearest), and
// what that tells: whether the turn has come (blocked), whether the waiter
// is at the front (front), and which keys ahead it watches (watched). The
// wait that keeps it up to date is in turn.go.

import (
	"math"
	"slices"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// place is where our key stands in its queue: its slot, its create
// revision and the keys ahead of it.
type place struct {
	*Slot
	rev   int64
	ahead []*mvccpb.KeyValue
	// far and farN are the weight and number of blocking keys listed
	// ahead that a waiter does not keep in ahead (see keepNearest): it
	// watches only a few, so it keeps only the nearest.
	far  int64
	farN int
	// peers is how many keys like ours that do not block us (readers, to
	// a reader) lie between the nearest key that blocks us and ours, as
	// the last list showed (unknownPeers when that is not known): a
	// waiter with frontKeys of them ahead is not at the front (place.front).
	// peersNext is how many lie between the two nearest keys that block
	// us, which peers takes in when the nearest goes (place.drop).
	peers, peersNext int
	// unlisted: a limited list (Rule.newest) did not reach the oldest key:
	// older keys may block us too. far and farN then count one such key,
	// unseen, so that only a read that lists them lets the turn come.
	unlisted bool
}

// frontKeys bounds the front of a queue (place.front): a waiter is there
// while the blocking weight ahead of it exceeds its room by at most
// frontKeys (a Mutex's first two waiters, a one-permit Semaphore's first
// two), or, under a rule whose keys do not block each other (readers),
// while one key blocks it and fewer than frontKeys keys like its own lie
// between that key and its own (the first two readers behind a writer).
const frontKeys = 2

// keepKeys is how many of the nearest keys ahead a waiter keeps at least
// (place.keepNearest), so that a reader behind a few writers, or a Mutex's
// waiter, rereads only those when a key it watches goes.
const keepKeys = 4

// unknownPeers marks place.peers or place.peersNext unknown: keys that
// blocked us went, and how many keys like ours lie behind the nearest one
// left was not read.
const unknownPeers = math.MaxInt

// front reports whether the waiter lists every key that blocks it and is
// at the front of its queue (see frontKeys), or one delete of a key it
// lists would give it the turn (a Semaphore's waiter behind a large
// acquire): it then watches the whole prefix on one watch
// (stream.waitQueue).
func (p *place) front() bool {
	if p.farN > 0 {
		return false
	}
	w := p.rule.weight(p.ahead)
	if p.rule.peers {
		return p.peers < frontKeys && w <= addWeights(p.rule.room, 1)
	}
	if w <= addWeights(p.rule.room, frontKeys) {
		return true
	}
	for i := range p.ahead {
		if w-p.rule.weight(p.ahead[i:i+1]) <= p.rule.room {
			return true
		}
	}
	return false
}

// frontWithout reports whether the waiter would be blocked and at the
// front once key, a key ahead it keeps, is gone.
func (p *place) frontWithout(key string) bool {
	i := slices.IndexFunc(p.ahead, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == key })
	if i < 0 {
		return false
	}
	u := *p
	u.ahead = slices.Clone(p.ahead)
	u.drop(i)
	return u.blocked() && u.front()
}

// watched returns the keys ahead a waiter that is not at the front watches
// besides its own: a run of them whose weight exceeds the room, so that the
// turn cannot come before one of them goes, taken past the nearest
// frontKeys keys when the keys behind those weigh enough, so that the
// waiter wakes when it may have come to the front (a Mutex's waiter watches
// the third key ahead of it), else the nearest such run (a reader among
// many behind one writer watches that writer). A key ahead that goes
// without waking the waiter leaves it blocked by the run.
func (p *place) watched() []*mvccpb.KeyValue {
	i, end := p.watchedRun()
	return p.ahead[i:end]
}

// watchedRun returns the bounds of watched's run in p.ahead. Under a rule
// whose keys ahead may hold together, it takes in keys behind it until
// wakesFirst holds.
func (p *place) watchedRun() (i, end int) {
	end = max(0, len(p.ahead)-frontKeys)
	if p.rule.weight(p.ahead[:end]) <= p.rule.room {
		end = len(p.ahead)
	}
	i, w := end, int64(0)
	for i > 0 && w <= p.rule.room {
		i--
		w = addWeights(w, p.rule.weight(p.ahead[i:i+1]))
	}
	for end < len(p.ahead) && !p.wakesFirst(i, end) {
		end++
	}
	return i, end
}

// wakesFirst reports whether the delete of a key of the run p.ahead[i:end]
// reaches the waiter before its turn can come, in whatever order the keys
// ahead go: the run less any one of its keys, with the keys behind it that
// wait for it (Rule.waits), still weighs more than the room. Else the turn
// could come on a watched delete (a writer behind three readers that
// watched the oldest, released last), and be taken with a read.
func (p *place) wakesFirst(i, end int) bool {
	if p.rule.waits == nil {
		return true
	}
	run := p.ahead[i:end]
	w, heaviest := p.rule.weight(run), int64(0)
	for j := range run {
		heaviest = max(heaviest, p.rule.weight(run[j:j+1]))
	}
	w -= heaviest
	for j, kv := range p.ahead[end:] {
		if p.rule.waits(p.prefix, run, kv) {
			w = addWeights(w, p.rule.weight(p.ahead[end+j:end+j+1]))
		}
	}
	return w > p.rule.room
}

// blocked reports whether more weight that blocks us is listed ahead than
// the rule leaves room for.
func (p *place) blocked() bool { return addWeights(p.rule.weight(p.ahead), p.far) > p.rule.room }

// keepNearest keeps of the keys listed ahead, as small copies, all of them
// at the front, else those from keepStart on; the weight and number of the
// others go into far and farN, so that a waiter's memory does not grow
// with the queue ahead of it.
func (p *place) keepNearest() {
	start := 0
	if !p.front() {
		start = p.keepStart()
	}
	p.far = addWeights(p.far, p.rule.weight(p.ahead[:start]))
	p.farN += start
	kept := make([]*mvccpb.KeyValue, len(p.ahead)-start)
	for i, kv := range p.ahead[start:] {
		kept[i] = &mvccpb.KeyValue{Key: kv.Key, CreateRevision: kv.CreateRevision, Value: kv.Value}
	}
	p.ahead = kept
}

// keepStart returns the index in p.ahead from which a waiter away from the
// front keeps the keys ahead: the start of its watched run, or earlier, so
// that it keeps at least keepKeys keys and the nearest keys whose weight
// exceeds its room plus twice frontKeys (the front and a run past it). A
// waiter that moves up then rereads those keys, not the queue.
func (p *place) keepStart() int {
	i, _ := p.watchedRun()
	j, w := len(p.ahead), int64(0)
	for j > 0 && (len(p.ahead)-j < keepKeys || w <= addWeights(p.rule.room, 2*frontKeys)) {
		j--
		w = addWeights(w, p.rule.weight(p.ahead[j:j+1]))
	}
	return min(i, j)
}

// drop removes the key ahead at i, which went. Under a rule whose keys
// like ours do not block us (a reader): when it was the nearest, peers
// takes in those listed between it and the next (they only vanish: at
// most so many), and how many lie before the next is unknown until the
// queue is listed again; when it was the next, how many lie between the
// nearest and the one before is unknown.
func (p *place) drop(i int) {
	switch n := len(p.ahead); {
	case !p.rule.peers:
	case i == n-1 && p.peersNext != unknownPeers && p.peers != unknownPeers:
		p.peers, p.peersNext = p.peers+p.peersNext, unknownPeers
	case i == n-1:
		p.peers, p.peersNext = unknownPeers, unknownPeers
	case i == n-2:
		p.peersNext = unknownPeers
	}
	p.ahead = slices.Delete(p.ahead, i, i+1)
}

// list sets the keys ahead from kvs, a list of the keys under the prefix
// (listOpts: under a limited list, newest first; more: keys it did not
// reach exist).
func (p *place) list(kvs []*mvccpb.KeyValue, more bool) error {
	if p.rule.newest && len(kvs) > 0 && kvs[0].CreateRevision > kvs[len(kvs)-1].CreateRevision {
		kvs = slices.Clone(kvs)
		slices.Reverse(kvs)
	}
	ahead, err := p.blocking(kvs, p.rev)
	if err != nil {
		return err
	}
	p.ahead, p.far, p.farN, p.peers, p.peersNext, p.unlisted = ahead, 0, 0, 0, 0, p.rule.newest && more
	if p.unlisted && len(ahead) > 0 {
		p.far, p.farN = 1, 1
	}
	if p.rule.peers && len(ahead) > 0 {
		near, next := ahead[len(ahead)-1].CreateRevision, ahead[max(0, len(ahead)-2)].CreateRevision
		for _, kv := range kvs {
			switch {
			case kv.CreateRevision >= p.rev || !p.rule.In(p.prefix, kv):
			case kv.CreateRevision > near:
				p.peers++
			case kv.CreateRevision > next:
				p.peersNext++
			}
		}
	}
	return nil
}

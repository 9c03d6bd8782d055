package etcdsync

// The blocking rules: which keys created before ours block us, what each
// weighs, how much blocking weight may remain ahead when we hold, and which
// of the keys ahead a waiter watches. A primitive is a rule (mutex.go,
// rwmutex.go, semaphore.go, election.go, group.go); the machinery is shared.

import (
	"math"

	"go.etcd.io/etcd/api/v3/mvccpb"
)

// rule says whom a contender waits for: which of the keys under its prefix
// created before its own block it, their weights, and how much blocking
// weight may remain ahead when it holds. A rule without blocks is one that
// no key blocks (a Group's member).
type rule struct {
	dir    string // our key's directory under the prefix: "" (NAME/<hex>), "read/", "write/"
	blocks func(prefix string, kv *mvccpb.KeyValue) bool
	weigh  func(kv *mvccpb.KeyValue) (int64, error) // a blocking key's weight (its value is read); nil: 1 each, keys only
	room   int64                                    // blocking weight that may remain ahead
	free   string                                   // under the prefix: what must be empty for a try to write at once
	shared bool                                     // holds of one session share the key (counted)
	// exact: watch only the keys that keep us out, not also the one behind
	// them, so that a release reaches only waiters it may let in; a waiter
	// whose nearest key goes while older ones were listed then reads once.
	exact bool
	// newest: every direct child blocks with weight 1 and none may remain,
	// so the newest few keys up to ours tell a waiter all it watches:
	// lists are limited to those (listLimit), not the whole queue.
	newest bool
}

// exclusive is the rule of a Mutex or an Election: every direct child of the
// prefix created before ours blocks, and none may remain.
var exclusive = rule{blocks: func(prefix string, kv *mvccpb.KeyValue) bool { return isChild(prefix, string(kv.Key)) }, newest: true}

// blocking returns the keys of kvs (sorted by create revision) created before
// rev that block, oldest first. A key whose weight the rule cannot read is an
// error wrapping ErrInvalidArgument.
func (sl *slot) blocking(kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	return sl.rule.blocking(sl.prefix, kvs, rev)
}

// blocking is slot.blocking for a key under prefix.
func (r *rule) blocking(prefix string, kvs []*mvccpb.KeyValue, rev int64) ([]*mvccpb.KeyValue, error) {
	if r.blocks == nil {
		return nil, nil
	}
	var out []*mvccpb.KeyValue
	for _, kv := range kvs {
		if kv.CreateRevision < rev && r.blocks(prefix, kv) {
			if r.weigh != nil {
				if _, err := r.weigh(kv); err != nil {
					return nil, err
				}
			}
			out = append(out, kv)
		}
	}
	return out, nil
}

// holds reports whether a key created at rev under prefix holds under r,
// given the keys of kvs: the weight of those that block it leaves it room.
func (r *rule) holds(prefix string, kvs []*mvccpb.KeyValue, rev int64) (bool, error) {
	ahead, err := r.blocking(prefix, kvs, rev)
	return err == nil && r.weight(ahead) <= r.room, err
}

// weight is the total weight of kvs, blocking keys that blocking accepted.
// It saturates at math.MaxInt64.
func (r *rule) weight(kvs []*mvccpb.KeyValue) int64 {
	if r.weigh == nil {
		return int64(len(kvs))
	}
	var w int64
	for _, kv := range kvs {
		n, _ := r.weigh(kv)
		w = addWeights(w, n)
	}
	return w
}

// addWeights adds two weights (≥ 0), saturating at math.MaxInt64.
func addWeights(a, b int64) int64 {
	if b > math.MaxInt64-a {
		return math.MaxInt64
	}
	return a + b
}

// nearest returns the keys ahead a waiter watches: the nearest ones whose
// weight exceeds the room (the turn cannot come before one of them goes),
// and, unless the rule is exact, the one behind them.
func (t *turn) nearest() []*mvccpb.KeyValue {
	i, w := len(t.ahead), int64(0)
	for i > 0 && w <= t.rule.room {
		i--
		w = addWeights(w, t.rule.weight(t.ahead[i:i+1]))
	}
	if t.rule.exact {
		return t.ahead[i:]
	}
	return t.ahead[max(0, i-1):]
}

// blocked reports whether more weight that blocks us is listed ahead than
// the rule leaves room for.
func (t *turn) blocked() bool { return addWeights(t.rule.weight(t.ahead), t.far) > t.rule.room }

// keepNearest keeps of the keys listed ahead only those a waiter watches
// (nearest), as small copies, and the weight and number of the others, so
// that a waiter's memory does not grow with the queue ahead of it.
func (t *turn) keepNearest() {
	near := t.nearest()
	t.far = addWeights(t.far, t.rule.weight(t.ahead[:len(t.ahead)-len(near)]))
	t.farN += len(t.ahead) - len(near)
	t.ahead = make([]*mvccpb.KeyValue, len(near))
	for i, kv := range near {
		t.ahead[i] = &mvccpb.KeyValue{Key: kv.Key, CreateRevision: kv.CreateRevision, Value: kv.Value}
	}
}

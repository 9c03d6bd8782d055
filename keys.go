package etcdsync

// Key names and layout: a contender's place (slot) is its session, the
// name's prefix NAME/, its key NAME/<lease-hex> (or NAME/<dir>/<lease-hex>
// under a rule with a directory) and the rule that says whom it waits for.
// Only direct children of the prefix take part in a queue.

import (
	"fmt"
	"strconv"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// checkName validates a primitive's name.
func checkName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty name", ErrInvalidName)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("%w: name %q has a NUL byte", ErrInvalidName, name)
	}
	return nil
}

// slot is one contender's place: the session, the name's prefix, the key,
// and the rule that says whom it waits for.
type slot struct {
	s      *Session
	prefix string // NAME/
	key    string // NAME/<lease-hex>, or NAME/read/<lease-hex> and so on (rule.dir)
	kind   string // of primitive: mutex, election, rwmutex, semaphore, group
	rule   *rule
}

// name is the primitive's name: the prefix without its slash.
func (sl *slot) name() string { return strings.TrimSuffix(sl.prefix, "/") }

func newSlot(s *Session, name, kind string) (slot, error) {
	if s == nil {
		return slot{}, fmt.Errorf("%w: nil session", ErrInvalidArgument)
	}
	if err := checkName(name); err != nil {
		return slot{}, err
	}
	return slot{s: s, prefix: name + "/", kind: kind}.with(&exclusive), nil
}

// with returns the slot under rule r, its key in r's directory. The prefix
// is the start of the key's string, so a slot holds one string, not two.
func (sl slot) with(r *rule) slot {
	n := len(sl.prefix)
	sl.rule, sl.key = r, sl.prefix+r.dir+strconv.FormatInt(int64(sl.s.Lease()), 16)
	sl.prefix = sl.key[:n]
	return sl
}

// isChild reports whether key is a direct child NAME/<hex> of prefix: the
// only keys that take part in a queue (a lock on NAME/x never blocks NAME).
func isChild(prefix, key string) bool {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok || rest == "" {
		return false
	}
	for i := 0; i < len(rest); i++ {
		if c := rest[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// listOp lists the keys under the prefix (see listOpts), limited when the
// rule needs only the newest; under a rule that nothing blocks, it reads
// only our own key (nothing can be ahead of it).
func (sl *slot) listOp() clientv3.Op {
	if sl.rule.blocks == nil {
		return clientv3.OpGet(sl.key)
	}
	return clientv3.OpGet(sl.prefix, sl.listOpts(false)...)
}

// listOpts lists the keys under the prefix in create-revision order, with
// their values only when the rule weighs them; unless full, under a rule
// that needs only the newest keys (rule.newest), the newest listLimit of
// them, newest first (see turn.list), so that a reply does not grow with
// the queue.
func (sl *slot) listOpts(full bool) []clientv3.OpOption {
	if sl.rule.newest && !full {
		return []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithKeysOnly(),
			clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortDescend), clientv3.WithLimit(listLimit)}
	}
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	if sl.rule.weigh == nil {
		opts = append(opts, clientv3.WithKeysOnly())
	}
	return opts
}

// listLimit is how many of the newest keys a limited list has: ours and
// three before it, of which a waiter watches two.
const listLimit = 4
